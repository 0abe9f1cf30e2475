"""A process that has imported torch and transformers once and forks each ``rlhf`` run the tests start
(:func:`tests.helpers.run_subprocess`), so that a run does not spend its first seconds of CPU importing
them again (some 8 s of CPU per run on a two-core CI machine; a module of short local runs such as
test_checkpoints takes half the time).

Started as ``python -m tests.warm_server FD`` (from the repository root) by ``tests.helpers._WarmCli``,
it reads one JSON request per line from the socket FD: ``{"args", "cwd", "env", "out", "err"}``. For each it forks; the
parent answers the child's pid, waits for it and answers its exit code as ``subprocess`` reports one
(negative: the signal that ended it). The child becomes what ``python -m rlhf_plugins.cli ARGS`` would
be, started in ``cwd`` with ``env``, stdout and stderr to the files named: its ``sys.path`` takes the
request's PYTHONPATH, it runs the CLI module as ``__main__`` and leaves through the interpreter's own
exit (threads joined, atexit handlers run, streams flushed), as a fresh process does.

What a forked run cannot show, tests keep to a fresh interpreter (``run_subprocess(..., fresh=True)``):
what third-party imports print, packages pip-installed during the test run (their ``.pth`` files are
read at start-up), import-time settings of the preloaded libraries. Linux only (elsewhere every run
is fresh: forking after torch's import is what DataLoader workers do on Linux, not on macOS). Nothing
imported here starts a thread beyond torch's own idle one (checked before the first fork), so the fork
copies no lock held by another thread.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading

#: what every run imports first and that starts no thread of its own beyond torch's (datasets is left out:
#: pyarrow starts jemalloc's background thread); Ray, vLLM and DeepSpeed are imported by the runs themselves
PRELOAD = ("transformers", "transformers.cache_utils", "transformers.masking_utils",
           "transformers.models.llama.modeling_llama", "safetensors.torch")


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def preload() -> None:
    """Import :data:`PRELOAD`. torch's import leaves one idle native thread, which its fork handlers make
    safe (DataLoader workers fork after it); anything more, or any Python thread, and this refuses."""
    import importlib

    import torch  # noqa: F401

    allowed = native_threads()
    for name in PRELOAD:
        importlib.import_module(name)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (lazy modules)

    if threading.active_count() != 1 or native_threads() > allowed:
        raise RuntimeError("a preloaded module started a thread: forking this process is not safe")


def serve(sock: socket.socket) -> dict:
    """Fork a child per request; return the request in the child, never in this process."""
    stream = sock.makefile("rwb", buffering=0)
    while True:
        line = stream.readline()
        if not line:
            os._exit(0)
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            stream.close()
            sock.close()
            return request
        stream.write(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        stream.write(f"{os.waitstatus_to_exitcode(status)}\n".encode())


def become_the_run(request: dict) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((0, os.devnull), (1, request["out"]), (2, request["err"])):
        target = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # as `python -m` starts: the working directory, then PYTHONPATH, then the interpreter's own paths
    sys.path[:] = [os.getcwd(), *extra, *(p for p in sys.path[1:] if p not in extra)]
    import importlib.util

    importlib.invalidate_caches()
    sys.argv = [importlib.util.find_spec("rlhf_plugins.cli").origin, *request["args"]]


if __name__ == "__main__":
    preload()
    run = serve(socket.socket(fileno=int(sys.argv[1])))
    become_the_run(run)
    import runpy

    runpy.run_module("rlhf_plugins.cli", run_name="__main__", alter_sys=True)
