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


def take_over(cwd: str, env: dict, fds: list[int], path: list[str]) -> None:
    """Become, in a forked child, a process started in ``cwd`` with ``env``, its stdin, stdout and stderr on
    ``fds`` (closed once in place) and importing from ``path`` (what both this server and
    :mod:`tests.ray_zygote` do before running what their client asked)."""
    import importlib

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    importlib.invalidate_caches()


def become_the_run(request: dict) -> None:
    fds = [os.open(os.devnull, os.O_RDONLY),
           *(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC) for name in ("out", "err"))]
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    # as `python -m` starts: the working directory, then PYTHONPATH, then the interpreter's own paths
    cwd = os.path.realpath(request["cwd"])  # what os.getcwd() reports there
    take_over(cwd, request["env"], fds, [cwd, *extra, *(p for p in sys.path[1:] if p not in extra)])
    import importlib.util

    sys.argv = [importlib.util.find_spec("rlhf_plugins.cli").origin, *request["args"]]


if __name__ == "__main__":
    preload()
    run = serve(socket.socket(fileno=int(sys.argv[1])))
    become_the_run(run)
    import runpy

    runpy.run_module("rlhf_plugins.cli", run_name="__main__", alter_sys=True)
