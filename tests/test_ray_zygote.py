"""The tests' Ray workers forked from :mod:`tests.ray_zygote` are what a fresh worker is: started by the
raylet under the same command line, in the same working directory and environment, with the same import
path, and they end as a fresh one would: with its exit status or signal, killed with their stand-in,
their stand-in killed with them."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.ray_zygote import SITE, SOCKET_ENV, STAND_IN_ENV

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]

#: stands in for Ray's worker entry (the hand-over matches the script's name): reports what it sees, then
#: does what its first argument says
WORKER = textwrap.dedent("""
    import os, signal, sys, time
    print("torch", "torch" in sys.modules)
    print("cwd", os.getcwd())
    print("env", os.environ.get("PROBE_VALUE"))
    print("path", repr(sys.path))
    print("first", sys.path[0] == os.path.dirname(os.path.realpath(__file__)))
    print("argv", " ".join(sys.argv[1:]))
    print("parent", os.getppid())
    print("pid", os.getpid())
    sys.stdout.flush()
    if sys.argv[1] == "exit":
        sys.exit(7)
    if sys.argv[1] == "signal":
        os.kill(os.getpid(), signal.SIGTERM)
    signal.signal(signal.SIGUSR1, lambda *_: (print("got SIGUSR1", flush=True), sys.exit(0)))
    print("waiting", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def zygote(ray_workers_from_a_zygote):
    if ray_workers_from_a_zygote is None:
        pytest.skip("no zygote in this session (RLHF_TEST_FRESH_RUNS=1)")
    ray_workers_from_a_zygote.wait_listening()  # once its imports are done
    return ray_workers_from_a_zygote


@pytest.fixture
def worker(tmp_path):
    (tmp_path / "default_worker.py").write_text(WORKER)
    (tmp_path / "lib").mkdir()

    def start(then: str, zygote_on: bool = True, socket_path: str | None = None) -> subprocess.Popen:
        env = {**os.environ, "PROBE_VALUE": "given", "PYTHONPATH": os.pathsep.join(
            [os.environ.get("PYTHONPATH", ""), str(tmp_path / "lib")])}
        if not zygote_on:
            env.pop(SOCKET_ENV)
        if socket_path is not None:  # a server of the test's own, the hand-over on the path as the tests set it
            env[SOCKET_ENV] = socket_path
            env["PYTHONPATH"] = os.pathsep.join([str(SITE), env["PYTHONPATH"]])
        return subprocess.Popen([sys.executable, str(tmp_path / "default_worker.py"), then], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    return start


def report(proc: subprocess.Popen) -> dict[str, str]:
    out, err = proc.communicate(timeout=120)
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines() if " " in line}


def test_a_forked_worker_sees_what_a_fresh_one_sees_and_exits_with_its_status(zygote, worker, tmp_path):
    forked, fresh = worker("exit"), worker("exit", zygote_on=False)
    got, want = report(forked), report(fresh)
    assert (forked.returncode, fresh.returncode) == (7, 7)
    assert got["torch"] == "True" and want["torch"] == "False"  # forked from the process that imported it
    assert int(got["parent"]) == zygote.server.pid and int(want["parent"]) == os.getpid()
    for key in ("cwd", "env", "path", "first", "argv"):
        assert got[key] == want[key], key
    assert got["cwd"] == str(tmp_path) and got["env"] == "given" and got["first"] == "True"
    assert str(tmp_path / "lib") in got["path"]


def test_a_forked_worker_ended_by_a_signal_ends_its_stand_in_by_it(zygote, worker):
    proc = worker("signal")
    report(proc)
    assert proc.returncode == -signal.SIGTERM


def test_the_stand_in_forwards_signals_to_the_forked_worker(zygote, worker):
    proc = worker("wait")
    assert proc.stdout.readline().startswith("torch True")
    while proc.stdout.readline().strip() != "waiting":
        pass
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=60)
    assert "got SIGUSR1" in out and proc.returncode == 0


def test_a_signal_sent_before_the_stand_in_knows_its_child_reaches_the_child(worker, tmp_path):
    """The window between the hand-over and the zygote's answer, held open: a server of the zygote's protocol
    answers only after the test has signalled the stand-in (which then holds the signal pending, not
    delivered) and started the child; the child gets the signal and the stand-in ends with its status. Were
    the signal not held back, its default action would end the stand-in alone (status -SIGUSR1)."""
    import json
    import socket

    path = str(tmp_path / "zygote.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(1)
    server.settimeout(60)
    child = None
    try:
        proc = worker("wait", socket_path=path)
        conn, _ = server.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        for fd in fds:
            os.close(fd)
        assert json.loads(message)["pid"] == proc.pid
        proc.send_signal(signal.SIGUSR1)
        assert _pending(proc.pid) & (1 << (signal.SIGUSR1 - 1))  # held back, the stand-in alive
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        assert proc.poll() is None, f"the stand-in ended at the signal (status {proc.returncode})"
        conn.send(str(child.pid).encode())
        assert child.wait(timeout=60) == 0 and child.stdout.read().strip() == "got SIGUSR1"
        conn.send(b"0")
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        server.close()
        if child is not None and child.poll() is None:
            child.kill()


#: the child the test's server starts for the stand-in: says when its handler is in place
CHILD = ("import signal, sys, time\n"
         "signal.signal(signal.SIGUSR1, lambda *_: (print('got SIGUSR1', flush=True), sys.exit(0)))\n"
         "print('ready', flush=True)\ntime.sleep(60)\n")


def _pending(pid: int) -> int:
    """The signals pending for a process (its ShdPnd mask in /proc)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("ShdPnd:"):
            return int(line.split()[1], 16)
    return 0


def test_a_killed_stand_in_takes_its_forked_worker_with_it(zygote, worker):
    proc = worker("wait")
    seen = dict(proc.stdout.readline().rstrip("\n").split(" ", 1) for _ in range(8))
    child = int(seen["pid"])
    assert child != proc.pid and int(seen["parent"]) == zygote.server.pid and _alive(child)
    proc.kill()
    proc.wait(timeout=60)
    _wait_until_ended(child)
    assert not _alive(child)


class WorkerProbe:
    def report(self) -> dict:
        return {"pid": os.getpid(), "parent": os.getppid(), "group": os.getpgid(0), "torch": "torch" in sys.modules,
                "script": os.path.basename(sys.argv[0]), "stand_in": int(os.environ[STAND_IN_ENV])}


def test_a_ray_actor_runs_in_a_forked_worker_that_ends_with_its_stand_in(zygote, local_ray):
    ray = local_ray
    actor = ray.remote(WorkerProbe).remote()
    info = ray.get(actor.report.remote(), timeout=120)
    assert info["parent"] == zygote.server.pid and info["torch"] and info["script"] == "default_worker.py"
    assert info["group"] == info["pid"]  # a process group of its own, as the raylet gives a fresh worker
    assert "default_worker.py" in open(f"/proc/{info['stand_in']}/cmdline").read()  # the process the raylet started
    os.kill(info["stand_in"], signal.SIGKILL)
    _wait_until_ended(info["pid"])  # the worker follows its stand-in (its watch thread kills it)
    assert not _alive(info["pid"])
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.report.remote(), timeout=120)
    again = ray.get(ray.remote(WorkerProbe).remote().report.remote(), timeout=120)
    assert again["pid"] != info["pid"] and again["parent"] == zygote.server.pid


def _wait_until_ended(pid: int) -> None:
    """Block until process ``pid`` (not necessarily our child) has ended, or for at most 120 s: the caller's
    liveness assertion then fails the test instead of a mechanism that never ends it hanging the run."""
    try:
        ended = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        select.select([ended], [], [], 120)
    finally:
        os.close(ended)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, not a zombie (Z) and not being reaped (X, dead: the state its
    parent's wait leaves it in until its entry goes, which a read can catch)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
