"""The tests' CLI runs forked from a warm process (:mod:`tests.warm_server`) are what a fresh
``python -m rlhf_plugins.cli`` is: the same working directory, environment, import path, output,
exit status (a signal's included) and interpreter exit."""
from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

from tests.helpers import run_subprocess

#: a plugin file that reports, from inside the run, what the run sees, then does what SHOW_THEN says
PROBE = textwrap.dedent("""
    import atexit, os, signal, sys, threading, time
    import found_on_pythonpath
    print("cwd", os.getcwd())
    print("env", os.environ.get("PROBE_VALUE"), os.environ.get("LEFT_OUT"))
    print("path0", sys.path[0])
    print("argv", " ".join(sys.argv[1:3]))
    print("main", sys.modules["__main__"].__spec__.name)
    sys.stdout.flush()
    atexit.register(lambda: print("atexit ran", flush=True))
    then = os.environ["SHOW_THEN"]
    if then == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if then == "hang":
        print("pid", os.getpid(), flush=True)
        time.sleep(600)
    if then == "thread":  # a non-daemon thread the interpreter's exit waits for
        threading.Thread(target=lambda: (time.sleep(1), print("thread finished", flush=True))).start()

    def probe_reward(prompts, completions, **kwargs):
        return [0.0] * len(completions)
""")


@pytest.fixture
def probe(tmp_path, monkeypatch):
    (tmp_path / "probe.py").write_text(PROBE)
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "found_on_pythonpath.py").write_text("")
    monkeypatch.setenv("LEFT_OUT", "from the test process")

    def run(then: str, fresh: bool, timeout: int = 300) -> subprocess.CompletedProcess:
        env = {"PROBE_VALUE": "given", "SHOW_THEN": then, "PYTHONPATH": str(lib), "RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"}
        return run_subprocess("plugins", "--plugin", "probe.py", cwd=tmp_path, env=env, timeout=timeout, fresh=fresh)

    return run


def lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.split(" ")[0] in
            ("cwd", "env", "path0", "argv", "main", "atexit", "thread")]


@pytest.mark.parametrize("then", ["exit", "thread"])
def test_a_warm_run_sees_and_ends_as_a_fresh_one(probe, tmp_path, then):
    warm, fresh = probe(then, fresh=False), probe(then, fresh=True)
    assert warm.returncode == fresh.returncode == 0, warm.stderr[-2000:]
    assert lines(warm) == lines(fresh)
    assert lines(warm)[:5] == [f"cwd {tmp_path}", "env given from the test process", f"path0 {tmp_path}",
                               "argv plugins --plugin", "main rlhf_plugins.cli"]
    assert lines(warm)[5:] == (["atexit ran"] if then == "exit" else ["thread finished", "atexit ran"])


def test_a_warm_run_killed_by_a_signal_reports_it(probe):
    killed = probe("kill", fresh=False)
    assert killed.returncode == -9 and "atexit ran" not in killed.stdout


def test_a_warm_run_past_its_timeout_is_killed_and_raises(probe):
    with pytest.raises(subprocess.TimeoutExpired) as hung:
        probe("hang", fresh=False, timeout=5)
    (pid,) = [int(line.split()[1]) for line in hung.value.output.splitlines() if line.startswith("pid ")]
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
        os.kill(pid, 0)
    assert probe("exit", fresh=False).returncode == 0  # the warm process serves the next run
