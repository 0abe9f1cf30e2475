"""Checkpoints and resume: atomic writes, exact continuation after SIGKILL (three kill points, one
during a checkpoint write), signals, errors that keep the run, plugin state, damaged checkpoints."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlhf_plugins.training.runlog import MEASURED
from tests.helpers import KILLER, clean_env, metrics_of, run_subprocess, samples_of

RUN = ["--train.steps", "8", "--train.save_every", "2", "--train.prompts_per_step", "4",
       "--generation.n_samples_per_prompt", "4", "--train.progress", "false", "--learner.epochs", "2",
       "--learner.mini_batch_size", "8", "--reward.normalize", "true", "--algo.kl.controller", "adaptive",
       "--eval.enabled", "false", "--train.log_samples_every", "1"]



def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows]


def train(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_subprocess("train", *args, cwd=cwd, env={"RLHF_DISABLE_PLUGIN_AUTOLOAD": "1", **(env or {})})


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_model):
    path = tmp_path_factory.mktemp("ckpt")
    (path / "killer.py").write_text(KILLER)
    proc = train(path, "--plugin", "killer.py", *RUN, "--train.run_name", "whole")
    assert proc.returncode == 0, proc.stderr
    return path


@pytest.mark.parametrize("where, kill", [
    ("step", "step 4"),  # one step past a checkpoint
    ("step-before-checkpoint", "step 3"),  # just before the next one is written
    ("ckpt", "ckpt 4"),  # inside the write of a checkpoint
])
def test_sigkill_then_resume_gives_the_same_metrics_step_for_step(workdir, where, kill):
    name = f"killed-{where}"
    proc = train(workdir, "--plugin", "killer.py", *RUN, "--train.run_name", name, env={"KILL_AT": kill})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    run = workdir / "runs" / name
    assert not (run / "summary.json").exists()
    if where == "ckpt":  # the half-written checkpoint is invisible; the previous one is whole
        assert list((run / "checkpoints").glob(".tmp-*"))
        assert not (run / "checkpoints" / f"step-{int(kill.split()[1]):06d}").exists()
    resumed = train(workdir, "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    whole, again = metrics_of(workdir / "runs" / "whole"), metrics_of(run)
    assert [r["step"] for r in again] == list(range(8))  # no duplicated, no missing step
    assert comparable(again) == comparable(whole)
    # every step's 16 samples once, each as the uninterrupted run wrote it
    assert samples_of(run) == samples_of(workdir / "runs" / "whole") and len(samples_of(run)) == 8 * 16
    assert not list((run / "checkpoints").glob(".tmp-*"))  # cleaned by the next write
    assert json.loads((run / "summary.json").read_text())["steps"] == 8


def test_resume_from_an_older_checkpoint_folder_drops_the_later_lines(workdir):
    proc = train(workdir, "--plugin", "killer.py", *RUN, "--train.run_name", "older", "--train.keep_checkpoints", "0")
    assert proc.returncode == 0, proc.stderr
    run = workdir / "runs" / "older"
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == [f"step-{s:06d}" for s in (2, 4, 6, 8)]
    resumed = train(workdir, "--resume", str(run / "checkpoints" / "step-000004"))
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(metrics_of(run)) == comparable(metrics_of(workdir / "runs" / "whole"))
    assert samples_of(run) == samples_of(workdir / "runs" / "whole")  # steps 4-7's first samples dropped


def test_extending_a_finished_run(workdir):
    proc = train(workdir, *RUN, "--train.steps", "4", "--train.run_name", "short")
    assert proc.returncode == 0, proc.stderr
    run = workdir / "runs" / "short"
    resumed = train(workdir, "--resume", str(run), "--train.steps", "8")
    assert resumed.returncode == 0, resumed.stderr
    rows = metrics_of(run)
    assert [r["step"] for r in rows] == list(range(8))


def test_a_changed_config_is_refused_naming_the_keys(workdir):
    proc = train(workdir, "--resume", str(workdir / "runs" / "whole"), "--algo.kl.coef", "0.5",
                 "--learner.lr", "0.01")
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert "resuming" in line and "algo.kl.coef (0.001 -> 0.5)" in line and "learner.lr (0.0005 -> 0.01)" in line
    assert len(line.splitlines()) == 1


def test_a_run_saved_before_a_key_existed_resumes_and_a_value_given_for_it_is_a_change(workdir, tmp_path):
    """A run begun on an older release has no line for a key added since; its default keeps the old
    behaviour, so the run resumes -- unless the key is given a value now."""
    import shutil

    import yaml

    from rlhf_plugins.api import prepare_resume
    from rlhf_plugins.errors import ConfigError

    run = tmp_path / "older"
    shutil.copytree(workdir / "runs" / "whole", run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    del saved["generation"]["min_p"], saved["algo"]["policy_loss"]["top_entropy_quantile"]
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    config, _, plan = prepare_resume(run, {"train": {"steps": 10}}, autoload=False)
    assert plan.resume[0] == run and config.generation.min_p == 0.0 and config.train.steps == 10
    with pytest.raises(ConfigError, match=r"generation.min_p \(None -> 0.1\)"):
        prepare_resume(run, {"generation": {"min_p": 0.1}}, autoload=False)
    # a key whose default is not what runs did before it existed: the value that keeps the old behaviour
    del saved["learner"]["weight_decay_all"]  # every parameter was decayed before it
    del saved["learner"]["disable_dropout"]  # the model's dropout stayed as its config set it
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    learner = prepare_resume(run, autoload=False)[0].learner
    assert learner.weight_decay_all is True and learner.disable_dropout is False
    with pytest.raises(ConfigError, match=r"learner.weight_decay_all \(True -> False\)"):
        prepare_resume(run, {"learner": {"weight_decay_all": False}}, autoload=False)


def test_a_damaged_checkpoint_is_refused(workdir, tmp_path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(workdir / "runs" / "whole", run)
    weights = run / "checkpoints" / "step-000008" / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    proc = train(tmp_path, "--resume", str(run))
    assert proc.returncode == 2
    assert "is damaged: 'actor/model.safetensors' does not match its checksum" in proc.stderr
    assert train(tmp_path, "--resume", str(tmp_path / "nowhere")).stderr.strip().endswith(
        "does not exist; give a run directory or a checkpoint folder")


def test_plugin_state_is_checkpointed_and_restored(workdir):
    plugins = json.loads((workdir / "runs" / "whole" / "checkpoints" / "step-000008" / "plugins.json").read_text())
    assert plugins == {"killer": {"steps_seen": 8}}


def signal_plugin(path: Path, sends: list[int]) -> None:
    path.write_text(textwrap.dedent(f"""
        import os
        from rlhf_plugins import hookimpl
        @hookimpl
        def rlhf_after_step(step, metrics):
            if step == 2:
                for sig in {sends!r}:
                    os.kill(os.getpid(), sig)
    """))


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_finishes_the_step_checkpoints_and_says_how_to_resume(tmp_path, tiny_model, sig, code):
    signal_plugin(tmp_path / "sig.py", [int(sig)])
    proc = train(tmp_path, "--plugin", "sig.py", *RUN, "--train.run_name", "s")
    assert proc.returncode == code, proc.stderr
    run = tmp_path / "runs" / "s"
    assert proc.stderr.strip().splitlines()[-1] == f"rlhf: interrupted at step 3; resume with: rlhf train --resume {Path('runs/s')}"
    assert (run / "checkpoints" / "step-000003" / "manifest.json").is_file()
    assert len(metrics_of(run)) == 3 and not (run / "summary.json").exists()


def test_a_second_sigint_stops_at_once(tmp_path, tiny_model):
    signal_plugin(tmp_path / "sig.py", [int(signal.SIGINT), int(signal.SIGINT)])
    proc = train(tmp_path, "--plugin", "sig.py", *RUN, "--train.run_name", "s")
    assert proc.returncode == 130
    assert proc.stderr.strip().splitlines()[-1] == \
        f"rlhf: interrupted after step 3; resume with: rlhf train --resume {Path('runs/s')} (from the checkpoint of step 2)"
    assert not (tmp_path / "runs" / "s" / "checkpoints" / "step-000003").exists()  # no time taken to save


FLAKY = textwrap.dedent("""
    import os
    from pathlib import Path
    from rlhf_plugins import hookimpl, RewardFunction
    from rlhf_plugins.builtin_plugins.rewards import exact_match
    CALLS = [0]

    def flaky(prompts, completions, label=None, **kwargs):
        CALLS[0] += 1
        flag = Path(os.environ["FLAKY_FLAG"])
        if CALLS[0] == int(os.environ.get("FAIL_CALL", "4")) and not flag.exists():
            flag.write_text("failed once")
            raise ConnectionError("reward server went away")
        return exact_match(prompts, completions, label=label)

    @hookimpl
    def rlhf_reward_functions():
        yield RewardFunction("flaky", flaky)
""")


def test_an_error_mid_run_keeps_the_run_and_resuming_gives_the_same_run(workdir, tmp_path):
    (tmp_path / "flaky.py").write_text(FLAKY)
    env = {"FLAKY_FLAG": str(tmp_path / "flag")}
    whole = train(tmp_path, "--plugin", "flaky.py", *RUN, "--train.run_name", "whole",
                  env={**env, "FAIL_CALL": "0"})
    assert whole.returncode == 0, whole.stderr
    proc = train(tmp_path, "--plugin", "flaky.py", *RUN, "--train.run_name", "f", env=env)
    assert proc.returncode == 2
    run = tmp_path / "runs" / "f"
    line = proc.stderr.strip().splitlines()[-1]
    assert "reward 'flaky' (plugin 'flaky') at step 3 raised ConnectionError: reward server went away" in line
    assert f"the run is kept in {Path('runs/f')} (last complete step 3)" in line
    assert line.endswith(f"resume with: rlhf train --resume {Path('runs/f')}")
    # the failing step changed no weights: its start is checkpointed exactly
    assert (run / "checkpoints" / "step-000003" / "manifest.json").is_file() and len(metrics_of(run)) == 3
    resumed = train(tmp_path, "--resume", str(run), env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(metrics_of(run)) == comparable(metrics_of(tmp_path / "runs" / "whole"))


def test_reward_retries_absorb_a_transient_error(tmp_path, tiny_model):
    (tmp_path / "flaky.py").write_text(FLAKY)
    proc = train(tmp_path, "--plugin", "flaky.py", *RUN, "--train.steps", "4", "--reward.max_retries", "2",
                 "--train.run_name", "r", env={"FLAKY_FLAG": str(tmp_path / "flag"), "FAIL_CALL": "2"})
    assert proc.returncode == 0, proc.stderr
    rows = metrics_of(tmp_path / "runs" / "r")
    assert [r["reward/retries"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    assert "retrying (1 of 2)" in proc.stderr


def test_a_failed_checkpoint_write_leaves_the_previous_one_intact(rlhf, monkeypatch):
    from rlhf_plugins.training import checkpoint

    real = checkpoint.checksum

    def disk_full(path):
        if "step-000004" in str(path):
            raise OSError(28, "No space left on device")
        return real(path)

    monkeypatch.setattr(checkpoint, "checksum", disk_full)
    code, _, err = rlhf("train", *RUN, "--train.run_name", "full")
    assert code == 2
    assert "cannot write the checkpoint of step 4 under" in err and "No space left on device" in err
    assert "the previous checkpoint is intact" in err and "the run is kept in" in err
    run = Path("runs/full")
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000002"]
    monkeypatch.setattr(checkpoint, "checksum", real)
    assert checkpoint.verify(run / "checkpoints" / "step-000002")["step"] == 2


def test_keep_checkpoints_prunes_the_oldest(workdir):
    names = sorted(p.name for p in (workdir / "runs" / "whole" / "checkpoints").iterdir())
    assert names == ["step-000006", "step-000008"]


def _sized_checkpoints(run_dir: Path, sizes: list[int], keep: int, max_bytes: int) -> list[str]:
    """Write checkpoints of steps 1, 2, ... holding a file of each size; the names left after each pruning."""
    from rlhf_plugins.training import checkpoint

    for step, size in enumerate(sizes, 1):
        checkpoint.write(run_dir, step, lambda tmp, n=size: (tmp / "weights.bin").write_bytes(b"w" * n) and {},
                         keep, max_bytes)
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_a_size_limit_drops_the_oldest_checkpoints_until_the_rest_fit_and_keeps_the_newest(tmp_path):
    """OpenRLHF's --max_ckpt_mem: after each write, the oldest checkpoints go while those kept take more
    bytes on disk than the limit; the count limit applies first; the newest stays whatever its size."""
    sizes = [3000, 1000, 2000, 1500]
    _sized_checkpoints(tmp_path / "all", sizes, keep=0, max_bytes=0)
    on_disk = {int(p.name.split("-")[1]): sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
               for p in (tmp_path / "all" / "checkpoints").iterdir()}
    assert sorted(on_disk) == [1, 2, 3, 4] and all(on_disk[s + 1] > n for s, n in enumerate(sizes))  # + manifest
    last_two, slack = on_disk[3] + on_disk[4], 100  # a manifest's size moves by a few bytes (its times)
    assert _sized_checkpoints(tmp_path / "fit", sizes, 0, last_two + slack) == ["step-000003", "step-000004"]
    assert _sized_checkpoints(tmp_path / "tight", sizes, 0, last_two - slack) == ["step-000004"]
    assert _sized_checkpoints(tmp_path / "tiny", sizes, 0, 1) == ["step-000004"]  # the newest stays
    three = on_disk[2] + on_disk[3] + on_disk[4]
    assert _sized_checkpoints(tmp_path / "count", sizes, 2, three + slack) == ["step-000003", "step-000004"]
    assert _sized_checkpoints(tmp_path / "size", sizes, 3, last_two + slack) == ["step-000003", "step-000004"]


def test_keep_checkpoints_gb_on_a_run_keeps_the_checkpoints_that_fit(tmp_path, tiny_model):
    proc = train(tmp_path, *RUN, "--train.steps", "4", "--train.save_every", "1", "--train.keep_checkpoints", "0",
                 "--train.keep_checkpoints_gb", "1e-12", "--train.run_name", "small")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [p.name for p in (tmp_path / "runs" / "small" / "checkpoints").iterdir()] == ["step-000004"]


def test_sigint_from_outside_on_a_real_process(tmp_path, tiny_model):
    """A SIGINT sent by another process (a terminal, `ray job stop` sends SIGTERM) mid-run."""
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_plugins.cli", "train", *RUN, "--train.steps", "400",
                             "--train.run_name", "x"], cwd=tmp_path, env=clean_env({"RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "runs" / "x" / "metrics.jsonl"
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    steps = len(metrics_of(tmp_path / "runs" / "x"))
    assert f"interrupted at step {steps}" in err
    assert (tmp_path / "runs" / "x" / "checkpoints" / f"step-{steps:06d}").is_dir()
