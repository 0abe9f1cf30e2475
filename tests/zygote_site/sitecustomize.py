"""While the tests run, a Ray worker hands itself over to :mod:`tests.ray_zygote` (a process that imported
torch and transformers once) at interpreter start-up and stands in for the child forked for it: see there.
Every other process, and a worker when the server cannot be reached, starts as usual."""
import os
import sys

#: what a stand-in forwards to its child (held back from the hand-over until it knows the child)
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")


def _hand_over(path: str) -> None:
    import json
    import signal
    import socket

    forwarded = {getattr(signal, name) for name in FORWARDED}
    signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)  # a signal sent before the child is known waits for it
    request = {"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path, "pid": os.getpid()}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
        socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
        child = int(sock.recv(64))
    except (OSError, ValueError):
        sock.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
        return  # no server (or it ended): start as a fresh worker
    _stand_in(sock, child, forwarded)


def _stand_in(sock, child: int, forwarded: set) -> None:
    """Forward signals to the child until it ends, then end as it did; never return."""
    import signal

    try:
        for sig in forwarded:
            signal.signal(sig, lambda s, _frame: os.kill(child, s))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)  # those sent meanwhile reach the child now
        answer = sock.recv(64)
        code = int(answer) if answer else -signal.SIGKILL  # the server ended: so did the child (it watches us)
    except BaseException:
        code = -signal.SIGKILL
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal whose default is not to end the process: the shell's status for it
    os._exit(code)


if os.environ.get("RLHF_TEST_RAY_ZYGOTE") and sys.platform.startswith("linux") and sys.argv \
        and os.path.basename(sys.argv[0]) == "default_worker.py":
    _hand_over(os.environ["RLHF_TEST_RAY_ZYGOTE"])
