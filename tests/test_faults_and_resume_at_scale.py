"""Checkpoints of DeepSpeed learners (ZeRO-2 and 3, local and two Ray ranks) resume within 1e-5 of
the uninterrupted run; on Ray a killed engine or learner rank is restarted and the run ends with
every step; a call that hangs stops the run naming the role, rank and method."""
from __future__ import annotations

import shutil
import textwrap

import pytest

from tests.helpers import metrics_of, run_subprocess

pytest.importorskip("deepspeed")
ray = pytest.importorskip("ray")
pytestmark = pytest.mark.integration

SHORT = ["--train.prompts_per_step", "4", "--generation.n_samples_per_prompt", "4", "--train.progress", "false",
         "--train.save_every", "2"]
RAY = ["--placement.strategy", "ray", "--ray.local_num_gpus", "4"]


def train(cwd, *args, env=None):
    return run_subprocess("train", *args, cwd=cwd, env={"RLHF_DISABLE_PLUGIN_AUTOLOAD": "1", **(env or {})})


def close(a: list[dict], b: list[dict], keys=("loss/policy", "reward/mean", "kl")) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for k in keys:
            assert x[k] == pytest.approx(y[k], abs=1e-5), (x["step"], k)


@pytest.mark.parametrize("placement", [
    ["--deepspeed.zero_stage", "2"],  # in the loop's process
    ["--deepspeed.zero_stage", "3", *RAY, "--ray.actor_workers", "2"],  # ZeRO-3's partitions over two ranks
], ids=["zero2-local", "zero3-ray-2-ranks"])
def test_deepspeed_resume_matches_the_uninterrupted_run(tmp_path, tiny_model, placement):
    """A copy of the whole run, resumed from its step-2 checkpoint (the later lines dropped), makes
    steps 2 and 3 again from DeepSpeed's restored partitions exactly as the whole run made them."""
    flags = ["--learner.backend", "deepspeed", *placement, *SHORT]
    whole = train(tmp_path, *flags, "--train.steps", "4", "--train.run_name", "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    runs = tmp_path / "runs"
    shutil.copytree(runs / "whole", runs / "part")
    ckpt = runs / "part" / "checkpoints" / "step-000002"
    assert list((ckpt / "actor" / "zero").glob("*optim_states.pt"))  # DeepSpeed's own partitions
    resumed = train(tmp_path, "--resume", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "after step 2" in resumed.stdout
    part, whole = metrics_of(runs / "part"), metrics_of(runs / "whole")
    assert [r["step"] for r in part] == [0, 1, 2, 3]
    assert part[:2] == whole[:2] and all(p["time/step"] != w["time/step"] for p, w in zip(part[2:], whole[2:]))  # remade
    close(whole, part)


KILLER = textwrap.dedent("""
    import os
    from rlhf_plugins import hookimpl
    DONE = set()

    @hookimpl
    def rlhf_after_step(step, metrics):
        # KILL_ROLES: "STEP:NAME,...": after STEP, kill the role actor whose name ends with NAME (once)
        for when, target in (item.split(":") for item in os.environ["KILL_ROLES"].split(",")):
            if step == int(when) and target not in DONE:
                import ray
                name = next(n for n in ray.util.list_named_actors() if n.endswith("-" + target))
                ray.kill(ray.get_actor(name))
                DONE.add(target)
""")


@pytest.mark.parametrize("kills, extra, restarted", [
    # an engine, then a DeepSpeed rank of the actor (the whole group comes back), in one run
    ("2:generation-0,4:actor-1", ["--learner.backend", "deepspeed", "--ray.actor_workers", "2"],
     ["generation", "actor"]),
    # the process hosting the policy's roles: all three come back, in one new actor
    ("2:actor+reference+generation-0", ["--ray.colocate", "hybrid"], ["generation, actor, reference"]),
], ids=["engine-then-learner-rank", "hybrid-host"])
def test_a_killed_role_is_restarted_and_the_run_ends_with_every_step(tmp_path, tiny_model, kills, extra, restarted):
    (tmp_path / "killer.py").write_text(KILLER)
    proc = train(tmp_path, "--plugin", "killer.py", *RAY, *SHORT, *extra, "--ray.max_restarts", "2",
                 "--train.steps", "6", "--train.run_name", "f", env={"KILL_ROLES": kills})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if "restarted" in line and "went back to step" in line]
    assert len(said) == len(restarted) and all(f"restarted {r} and went back to step" in line
                                               for r, line in zip(restarted, said)), proc.stdout[-3000:]
    rows = metrics_of(tmp_path / "runs" / "f")
    assert [r["step"] for r in rows] == list(range(6))
    assert rows[-1]["fault/restarts"] == len(restarted) and "fault/restarts" not in rows[0]


def test_without_restarts_a_dead_role_is_one_line_with_the_way_back(tmp_path, tiny_model):
    (tmp_path / "killer.py").write_text(KILLER)
    proc = train(tmp_path, "--plugin", "killer.py", *RAY, *SHORT, "--train.steps", "6", "--train.run_name", "f",
                 env={"KILL_ROLES": "2:generation-0"})
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert "role 'generation' (rank 0) in 'generate'" in line and "its process died" in line
    assert "the run is kept in" in line and "rlhf train --resume" in line


HANG = textwrap.dedent("""
    import time
    def slow(prompts, completions, **kwargs):
        time.sleep(600)
        return [0.0] * len(completions)
""")


def test_a_call_that_does_not_return_names_the_role_rank_and_method(tmp_path, tiny_model):
    (tmp_path / "slow.py").write_text(HANG)
    # roles start within --ray.ready_timeout (60 s) however short the call timeout is
    proc = train(tmp_path, "--plugin", "slow.py", *RAY, *SHORT, "--train.steps", "2", "--ray.call_timeout", "3")
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "role 'reward' (rank 0) in 'score' did not return within 3 s (--ray.call_timeout)" in line
