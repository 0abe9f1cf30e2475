"""--train.episodes (OpenRLHF's --num_episodes, TRL's num_train_epochs): passes over the training prompts,
the run's steps counted once the prompts are loaded; train.steps, when given, decides instead; a resumed
run extends by more episodes; OpenRLHF's and TRL's converters carry their epochs into it."""
from __future__ import annotations

import json

import pytest

from rlhf_plugins.commands.convert import convert
from rlhf_plugins.data.sampler import steps_for_episodes
from rlhf_plugins.integrations.trl_config import from_grpo_fields
from tests.helpers import metrics_of

FLAGS = ["--reward.functions", "exact_match", "--train.prompts_per_step", "4", "--generation.n_samples_per_prompt", "2",
         "--train.progress", "false", "--eval.enabled", "false", "--train.save_every", "0"]


def test_steps_by_hand():
    assert steps_for_episodes(1, 20, 4) == 5
    assert steps_for_episodes(0.5, 20, 4) == 3  # 10 prompts: two steps and a third that starts the next pass
    assert steps_for_episodes(2, 10, 16) == 2
    assert steps_for_episodes(0.01, 10, 16) == 1  # at least one step


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{a + 1}=", "label": str(2 * a + 1)}) + "\n" for a in range(20)))
    return str(path)


def test_episodes_count_the_steps_over_the_prompts_and_a_resume_extends_by_episodes(rlhf, prompts, tmp_path):
    code, out, err = rlhf("train", "--data.path", prompts, "--train.episodes", "0.5", "--train.run_name", "half", *FLAGS)
    assert code == 0, err
    run = tmp_path / "runs" / "half"
    assert "prompts: 20  steps: 3" in out and [r["step"] for r in metrics_of(run)] == [0, 1, 2]
    code, out, err = rlhf("train", "--resume", str(run), "--train.episodes", "1")
    assert code == 0, err
    assert [r["step"] for r in metrics_of(run)] == [0, 1, 2, 3, 4]  # one pass over 20 prompts, 4 a step


def test_given_steps_decide_over_episodes(rlhf, prompts, tmp_path):
    code, out, err = rlhf("train", "--data.path", prompts, "--train.episodes", "3", "--train.steps", "2",
                          "--train.run_name", "steps", *FLAGS)
    assert code == 0, err
    assert "steps: 2" in out and len(metrics_of(tmp_path / "runs" / "steps")) == 2


def test_openrlhf_and_trl_epochs_carry_into_episodes():
    assert convert(["--pretrain", "m"]).raw["train"]["episodes"] == 1  # OpenRLHF's default: one pass
    assert convert(["--pretrain", "m", "--num_episodes", "3"]).raw["train"]["episodes"] == 3
    raw, notes = from_grpo_fields({})  # TRL without max_steps: num_train_epochs (3) passes
    assert raw["train"]["episodes"] == 3.0 and "steps" not in raw["train"] and notes == []
    raw, _ = from_grpo_fields({"num_train_epochs": 0.5})
    assert raw["train"]["episodes"] == 0.5
    raw, _ = from_grpo_fields({"max_steps": 8, "num_train_epochs": 2})
    assert raw["train"]["steps"] == 8 and "episodes" not in raw["train"]
