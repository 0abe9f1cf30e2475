"""The whole RLHF recipe on the default task, as the README runs it: SFT, then a reward model
from the SFT policy, then PPO (GAE, critic started from the reward model) whose only reward is
that model; the reward model's score of the RL policy's held-out answers rises. Then the same
PPO with all four model groups and a generation engine on a local Ray cluster."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_plugins.models.tiny_model import task_rows
from rlhf_plugins.stages.heldout import evaluate_model
from tests.helpers import eval_rows_of, metrics_of, run_subprocess

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

#: the README's commands, with paths relative to the working directory
SFT = ["sft", "--train.run_name", "sft", "--train.progress", "false"]
RM = ["rm", "--model.path", "runs/sft/final", "--train.run_name", "rm", "--train.progress", "false"]
PPO = ["train", "--model.path", "runs/sft/final", "--data.path", "builtin:addition-train",
       "--reward.models", "runs/rm/final", "--algo.advantage.estimator", "gae", "--critic.path", "runs/rm/final",
       "--learner.lr", "3e-4", "--algo.kl.coef", "0.05", "--train.steps", "100", "--train.progress", "false"]


@pytest.fixture(scope="module")
def stages(tmp_path_factory, tiny_model):
    cwd = tmp_path_factory.mktemp("pipeline")
    for args in (SFT, RM):
        proc = run_subprocess(*args, cwd=cwd)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd


def test_ppo_on_the_reward_model_raises_its_score_of_held_out_sums(stages):
    """PPO whose only reward is the reward model: the reward model's mean score of sampled answers to the
    test split's sums (the run's own held-out evaluation, judged by its training reward) rises by 0.5 or
    more -- a Bradley-Terry logit: the reward model then prefers a PPO answer to an SFT one with probability
    about sigmoid(0.5) = 0.62 or more -- and the share it judges correct (score >= 1) rises. Measured: +1.1 to
    +1.9 over seeds and kernels (docs/pipeline.md). The share is not held to a margin: it is capped by the
    sums the reward model never scores as correct (its pass@8: 0.65-0.85, by the CPU's rounding).
    Exact-match accuracy is measured and bounded, not required to rise: it follows the reward model's
    mistakes, which depend on the CPU's rounding (+0.20 on AVX-512 machines, -0.05 on an AVX2 one)."""
    proc = run_subprocess(*PPO, "--train.run_name", "ppo", cwd=stages)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = (stages / "runs" / "ppo" / "config.yaml").read_text()
    assert "functions: []" in config  # no exact-match function in the loop: the reward model alone
    rows = metrics_of(stages / "runs" / "ppo")
    assert all(set(r) >= {"reward/mean", "critic/loss"} for r in rows)
    evals = eval_rows_of(stages / "runs" / "ppo")  # before the first step, after the last
    judged, scores = [r["eval/pass@1"] for r in evals], [r["eval/mean@8"] for r in evals]
    assert len(scores) == 2 and scores[1] >= scores[0] + 0.5, scores
    assert judged[1] > judged[0], judged
    held = task_rows("test")
    sft = evaluate_model(str(stages / "runs" / "sft" / "final"), held, n=16)
    ppo = evaluate_model(str(stages / "runs" / "ppo" / "final"), held, n=16)
    # measured (pass@1, temperature 1, 16 samples per sum): SFT 0.63 -> PPO 0.83 on AVX-512 machines,
    # 0.58 on an AVX2 EPYC (0.45-0.71 over seeds and KL coefficients there); never a collapse
    assert ppo["pass@1"] >= 0.3 and ppo["pass@16"] >= 0.5, (sft, ppo)
    rm = json.loads((stages / "runs" / "rm" / "summary.json").read_text())
    assert rm["pairwise_accuracy"] >= 0.9


@pytest.mark.integration
def test_the_four_model_groups_and_an_engine_on_ray(stages):
    pytest.importorskip("ray")
    proc = run_subprocess(*PPO[:-4], "--train.steps", "6", "--train.progress", "false", "--train.run_name", "ray",
                          "--placement.strategy", "ray", "--ray.local_num_gpus", "5", "--ray.colocate", "critic_reward",
                          "--ray.reward_workers", "2", "--train.prompts_per_step", "8", cwd=stages)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # actor, reference and the engine on their own bundles; critic and reward model share two
    assert "critic+reward: 2 bundle(s) of {'CPU': 1.0, 'GPU': 1.0}" in proc.stdout
    assert "actor: 1 bundle(s) of {'CPU': 1.0, 'GPU': 1.0}" in proc.stdout
    assert "reference:" in proc.stdout and "generation:" in proc.stdout
    rows = metrics_of(stages / "runs" / "ray")
    assert len(rows) == 6 and all("critic/loss" in r for r in rows)
    assert Path(stages / "runs" / "ray" / "final" / "model.safetensors").is_file()
