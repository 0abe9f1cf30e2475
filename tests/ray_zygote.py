"""A process that has imported torch and transformers once and forks each Ray worker process the tests' local
clusters start, so that a role actor does not spend its first seconds of CPU importing them again (some 8 s
of CPU per actor, measured; a whole test run starts ~180 such actors on two cores).

How a worker gets here: while the tests run, PYTHONPATH starts with :mod:`tests.zygote_site` (a folder
holding only a ``sitecustomize``) and ``RLHF_TEST_RAY_ZYGOTE`` names this server's socket; every process the
tests start inherits both (CLI runs, the clusters they start, the raylets' workers). A Ray worker
(``default_worker.py``) hands itself over at interpreter start-up, before it imports anything: it sends its
argv, environment, working directory and ``sys.path`` with its stdin, stdout and stderr. This server forks a
child that becomes that worker: it takes all of those, makes a process group of its own (the raylet gives
each worker one, and ends the group with the worker) and runs ``default_worker.py`` as ``__main__``, as the
fresh interpreter would have. The child registers with the raylet under its own pid (Ray matches a worker by
the id on its command line, as it must for workers started through a wrapper). The started process stays
as the child's stand-in: it forwards the signals it gets and ends as the child ended (its exit status or its
signal); a stand-in killed outright takes the child with it (the child watches it through a pidfd).

Any other process starts as usual, and so does a worker when the server is not (yet) listening: it binds
its socket only once the imports are done. ``run_subprocess(..., fresh=True)`` and
``RLHF_TEST_FRESH_RUNS=1`` leave it out. What the preload imports must start no thread (checked before the
first fork, as in :mod:`tests.warm_server`, whose preload this is); a worker's own threads start in the
child. Ray itself is not preloaded: it reads its configuration from the environment at import. Linux only.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tests.warm_server import preload, take_over

#: the socket the server listens on, in the environment of every process the tests start
SOCKET_ENV = "RLHF_TEST_RAY_ZYGOTE"
#: set in a forked worker: the pid of the process the raylet started, which stands in for it
STAND_IN_ENV = "RLHF_TEST_ZYGOTE_STAND_IN"
#: the folder whose ``sitecustomize`` hands a starting Ray worker over
SITE = Path(__file__).parent / "zygote_site"
ROOT = Path(__file__).parent.parent


class Zygote:
    """This test process's server: started when made, named in ``os.environ`` for every process started
    afterwards, ended by :meth:`stop` (or by this process's end: it watches its parent)."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="ray-zygote-")
        self.path = os.path.join(self.folder, "socket")
        self.log = Path(self.folder, "server.log")
        ready_r, ready_w = os.pipe()
        with self.log.open("w") as log:
            self.server = subprocess.Popen([sys.executable, "-m", "tests.ray_zygote", self.path, str(ready_w)],
                                           cwd=ROOT, pass_fds=(ready_w,), stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=log)
        os.close(ready_w)
        self._ready = os.fdopen(ready_r, "rb")
        self.listening = False
        os.environ[SOCKET_ENV] = self.path
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH")) if p)

    def wait_listening(self) -> None:
        """Block until the server listens (its imports done); raise with its log if it ended first."""
        if not self.listening:
            self.listening = self._ready.readline() == b"listening\n"
        if not self.listening:
            raise RuntimeError(f"the Ray worker zygote ended before it listened: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self._ready.close()
        os.environ.pop(SOCKET_ENV, None)
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE)]
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
        if not paths:
            del os.environ["PYTHONPATH"]
        self.server.terminate()
        self.server.wait()
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def serve(path: str, ready: int) -> tuple[dict, list[int], socket.socket]:
    """Say on ``ready`` once listening, then fork a child for each worker that connects; return its request,
    descriptors and connection in the child, never in this process (which ends when its parent does)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)  # only now: a worker that starts before this starts as a fresh process
    listener.listen(64)
    os.write(ready, b"listening\n")
    os.close(ready)
    parent = os.getppid()
    stand_ins: dict[int, socket.socket] = {}  # child pid -> the connection of the process it stands in for
    while True:
        ready = select.select([listener, wake_r], [], [], 1.0)[0]
        if os.getppid() != parent:
            os._exit(0)
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(stand_ins)
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        conn.settimeout(10)  # a worker stalled between connecting and asking holds up no other's reaping for long
        try:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        except OSError:
            message, fds = b"", []
        conn.settimeout(None)
        if not message or len(fds) != 3:  # a worker that went away (or stalled) before it asked
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for s in (listener, *stand_ins.values()):
                s.close()
            os.close(wake_r)
            os.close(wake_w)
            return json.loads(message), fds, conn
        for fd in fds:
            os.close(fd)
        stand_ins[pid] = conn
        try:
            conn.send(str(pid).encode())
        except OSError:  # the stand-in is gone: the child's watch ends the child
            pass


def _reap(stand_ins: dict[int, socket.socket]) -> None:
    """Tell each ended child's stand-in how it ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = stand_ins.pop(pid, None)
        if conn is not None:
            try:
                conn.send(str(os.waitstatus_to_exitcode(status)).encode())
            except OSError:
                pass
            conn.close()


def become_the_worker(request: dict, fds: list[int], conn: socket.socket) -> None:
    # as `python SCRIPT` starts: the script's folder, then what site built (PYTHONPATH, .pth files)
    take_over(request["cwd"], {**request["env"], STAND_IN_ENV: str(request["pid"])}, fds,
              [os.path.dirname(os.path.realpath(request["argv"][0])), *request["path"]])
    sys.argv = request["argv"]
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # OpenMP read it when torch loaded here
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    stand_in = os.pidfd_open(request["pid"])

    def follow_the_stand_in() -> None:
        # signals sent to the worker are the main thread's, as in a fresh one: Python runs a handler only
        # there, and a sleep there is cut short only by a signal delivered to it
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP})
        select.select([stand_in], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=follow_the_stand_in, daemon=True, name="zygote-stand-in-watch").start()
    conn.close()


if __name__ == "__main__":
    preload()
    request, fds, conn = serve(sys.argv[1], int(sys.argv[2]))
    become_the_worker(request, fds, conn)
    import runpy

    runpy.run_path(request["argv"][0], run_name="__main__")
