"""A run's samples (--train.log_samples_every, --train.print_samples; TRL's log_completions and
num_completions_to_print): each row's scores, advantage and columns by hand, the steps a run logs and the
table it prints, and TRL's fields. Exact resume of samples.jsonl: tests/test_checkpoints.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import metrics_of, random_rollout, samples_of, short_run, the_run


def test_each_row_holds_its_samples_scores_advantage_and_plain_columns():
    from rlhf_plugins.training.rollout import make_batch
    from rlhf_plugins.training.samples import sample_rows

    rollout = random_rollout(group=3, prompts=2, seed=4)
    rollout.completions = [f"c{i}" for i in range(6)]
    rollout.prompts = ["p0"] * 3 + [[{"role": "user", "content": "p1"}]] * 3  # a conversation's messages
    rollout.raw_scores = [0.0, 1.0, 0.5, 2.0, float("nan"), 1.0]
    rollout.scores = [s * 2 for s in rollout.raw_scores]  # shaped
    rollout.reward_components = {"a": [0.0, 1.0, None, 2.0, 0.0, 1.0], "b": [0.0, 0.0, 0.5, 0.0, 0.0, 0.0]}
    rollout.finish_reasons = ["stop", "length"] * 3
    rollout.columns = {"label": ["x", "x", "x", "y", "y", "y"], "image": [[1, 2]] * 6}  # a list: not plain
    batch = make_batch(rollout, pad_id=0)
    g = torch.Generator().manual_seed(0)
    batch["advantages"] = torch.randn(batch["action_mask"].shape, generator=g) * batch["action_mask"]
    rows = sample_rows(7, rollout, batch)
    for i, row in enumerate(rows):
        n = len(rollout.completion_ids[i])
        assert row["advantage"] == pytest.approx(float(batch["advantages"][i].sum()) / n, rel=1e-6)
        assert (row["step"], row["group"], row["completion"], row["tokens"]) == (7, i // 3, f"c{i}", n)
        assert row["finish_reason"] == rollout.finish_reasons[i] and row["columns"] == {"label": "xy"[i // 3]}
        assert row["rewards"] == {"a": rollout.reward_components["a"][i], "b": rollout.reward_components["b"][i]}
    assert [r["reward"] for r in rows] == [0.0, 1.0, 0.5, 2.0, None, 1.0]  # not finite: null in JSON
    assert [r["score"] for r in rows] == [0.0, 2.0, 1.0, 4.0, None, 2.0]
    assert rows[3]["prompt"] == [{"role": "user", "content": "p1"}]


def test_the_table_prints_prompts_and_completions_as_written_never_as_markup():
    from rich.console import Console

    from rlhf_plugins.tables import print_samples

    console = Console(record=True, width=200)
    rows = [{"prompt": [{"role": "user", "content": "[bold]2+2="}], "completion": "[red]4[/red]",
             "rewards": {"exact": 1.0, "format": None}, "reward": 1.0, "advantage": -0.25,
             "extra": {"golden": "[i]4"}}]  # a log_extra column, after the advantage as in TRL's table
    print_samples(console, rows, "step 3/9")
    text = console.export_text()
    assert "samples of step 3/9" in text and "user: [bold]2+2=" in text and "[red]4[/red]" in text
    assert "exact" in text and "format" in text and "-0.250" in text and "1.000" in text
    assert "golden" in text and "[i]4" in text and text.index("advantage") < text.index("golden")


def test_a_run_logs_every_nth_steps_samples_and_prints_the_first_ones(rlhf):
    from rlhf_plugins.builtin_plugins.rewards import exact_match

    code, out, err = rlhf("train", *short_run("--train.steps", "4", "--train.log_samples_every", "3",
                                              "--train.print_samples", "2"))
    assert code == 0, err
    run = the_run()
    rows, metrics = samples_of(run), metrics_of(run)
    assert [r["step"] for r in rows] == [0] * 16 + [3] * 16  # the first step and every 3rd: 4 prompts x 4
    for step in (0, 3):
        mine = [r for r in rows if r["step"] == step]
        labels = [r["columns"]["label"] for r in mine]
        assert [r["reward"] for r in mine] == exact_match([r["prompt"] for r in mine],
                                                          [r["completion"] for r in mine], label=labels)
        assert sum(r["reward"] for r in mine) / 16 == pytest.approx(metrics[step]["reward/mean"], abs=1e-12)
        assert all(r["rewards"] == {"exact_match": r["reward"]} for r in mine)
    assert "samples of step 1/4" in out and "samples of step 4/4" in out and "samples of step 2/4" not in out
    first = out.split("samples of step 1/4")[1].split("samples of step 4/4")[0]
    assert rows[0]["prompt"] in first and rows[1]["prompt"] in first


def test_trls_log_completions_and_num_completions_to_print_convert():
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    # logging_steps 4 of 2 updates a rollout: every 2 rollouts; None prints every sample (2 prompts x 4)
    raw, notes = from_grpo_fields({"log_completions": True, "logging_steps": 4, "num_iterations": 2,
                                   "per_device_train_batch_size": 8, "num_generations": 4})
    assert (raw["train"]["log_samples_every"], raw["train"]["print_samples"]) == (2, 8) and not notes
    raw, _ = from_grpo_fields({"log_completions": True, "num_completions_to_print": 3})
    assert (raw["train"]["log_samples_every"], raw["train"]["print_samples"]) == (10, 3)  # TRL's logging_steps 10
    raw, notes = from_grpo_fields({"num_completions_to_print": 3, "logging_steps": 5})
    assert "log_samples_every" not in raw["train"] and "logging_steps" in notes[0]  # not asked for: bookkeeping


def test_log_extra_columns_follow_their_samples_through_split_scoring_and_filtering(caplog):
    """TRL's log_extra columns: a reward batch scored in two parts (Ray workers) merges them, a part whose
    functions added none gives None; a column of the wrong length is left out with a warning; groups kept
    by dynamic filtering and rollouts put together keep each sample's value."""
    from rlhf_plugins.training.reward_role import RewardResult, whole_columns
    from rlhf_plugins.training.rollout import Rollout

    merged = RewardResult.merge([RewardResult([1.0, 0.0], {"a": [1.0, 0.0]}, extra={"why": ["x", "y"]}),
                                 RewardResult([0.5], {"a": [0.5]})])
    assert merged.extra == {"why": ["x", "y", None]} and merged.scores == [1.0, 0.0, 0.5]
    with caplog.at_level("WARNING"):
        assert whole_columns({"ok": [1, 2, 3], "short": [1]}, 3, "at step 4") == {"ok": [1, 2, 3]}
    assert "log_extra('short') gave 1 values for the 3 samples at step 4" in caplog.text
    rollout = random_rollout(group=2, prompts=3, seed=1)
    rollout.extra = {"why": list("abcdef")}
    kept = rollout.select_groups([2, 0])
    assert kept.extra == {"why": list("efab")}
    assert Rollout.concat([kept, random_rollout(group=2, prompts=1)]).extra == {"why": list("efab") + [None] * 2}


def test_log_extra_values_that_json_cannot_hold_are_written_as_text(tmp_path):
    """TRL's log_extra takes "any value convertible to string": a row holds such a value as its text, and
    ``samples.jsonl`` takes it (the run goes on)."""
    from fractions import Fraction

    from rlhf_plugins.training.rollout import make_batch
    from rlhf_plugins.training.runlog import MetricsLog
    from rlhf_plugins.training.samples import sample_rows

    rollout = random_rollout(group=2, prompts=1, seed=2)
    rollout.completions, rollout.scores = ["a", "b"], [1.0, 0.0]
    rollout.extra = {"ratio": [Fraction(1, 3), 0.5], "note": [None, "ok"]}
    batch = make_batch(rollout, pad_id=0)
    batch["advantages"] = torch.zeros(batch["action_mask"].shape)
    rows = sample_rows(0, rollout, batch)
    assert [r["extra"] for r in rows] == [{"ratio": "1/3", "note": None}, {"ratio": 0.5, "note": "ok"}]
    assert [r["reward"] for r in rows] == [1.0, 0.0] and "score" not in rows[0]  # unshaped: scores are the rewards
    log = MetricsLog(tmp_path)
    log.log(0, {"reward/mean": 0.5}, rows)
    log.close()
    assert samples_of(tmp_path) == rows


def test_rlhf_samples_shows_a_logged_step_ordered_and_says_which_steps_were_logged(rlhf):
    import json

    code, _, err = rlhf("train", *short_run("--train.log_samples_every", "2", "--train.run_name", "s"))
    assert code == 0, err
    code, _, err = rlhf("train", *short_run("--train.run_name", "none"))
    assert code == 0, err
    logged = [r for r in samples_of(Path("runs/s")) if r["step"] == 2]
    code, out, err = rlhf("samples", "runs/s")  # the last logged step, its first 8 samples
    assert code == 0, err
    assert "samples of step 2 of runs/s (8 of 16)" in out and logged[0]["completion"] in out
    code, out, err = rlhf("samples", "runs/s", "--step", "2", "-n", "0", "--sort", "advantage", "--json")
    assert code == 0, err
    shown = [json.loads(line) for line in out.splitlines()]
    assert shown == sorted(logged, key=lambda r: r["advantage"], reverse=True) and len(shown) == 16
    code, _, err = rlhf("samples", "runs/s", "--step", "1")
    assert code == 2 and err.strip() == "rlhf: error: step 1 logged no samples in 'runs/s'; logged steps: 0, 2"
    code, _, err = rlhf("samples", "runs/none")
    assert code == 2 and "holds no logged samples: train with --train.log_samples_every N" in err


# --- held-out evaluations' samples (--eval.log_samples) ---------------------------------------------

def test_evaluations_log_each_prompts_samples_which_give_the_metrics_resume_and_match_rlhf_eval(rlhf):
    import json

    from rlhf_plugins.builtin_plugins.rewards import exact_match
    from tests.helpers import eval_rows_of, eval_samples_of, with_eval

    flags = with_eval("--train.steps", "3", "--eval.every", "2", "--eval.log_samples", "true",
                      "--train.save_every", "1", "--train.run_name", "r")
    code, _, err = rlhf("train", *flags)
    assert code == 0, err
    code, _, err = rlhf("train", "--resume", "runs/r", "--train.steps", "5")  # evaluations at 4 and 5 added
    assert code == 0, err
    rows = eval_samples_of(Path("runs/r"))
    assert [r["step"] for r in rows] == [s for s in (0, 2, 3, 4, 5) for _ in range(20)]  # each prompt once a step
    for metrics in eval_rows_of(Path("runs/r")):
        mine = [r for r in rows if r["step"] == metrics["step"]]
        samples = [s for r in mine for s in r["samples"]]
        labels = [r["columns"]["label"] for r in mine for _ in r["samples"]]
        assert [s["score"] for s in samples] == exact_match([], [s["completion"] for s in samples], label=labels)
        assert all(s["correct"] == (s["score"] >= 1.0) for s in samples) and len(samples) == 20 * 8
        pass1 = sum(sum(s["correct"] for s in r["samples"]) / 8 for r in mine) / 20
        assert pass1 == pytest.approx(metrics["eval/pass@1"], abs=1e-12)
        assert sum(r["greedy"]["correct"] for r in mine) / 20 == pytest.approx(metrics["eval/greedy"], abs=1e-12)
    code, _, err = rlhf("eval", "runs/r", "--output", "report.json")  # the last evaluation again: the same samples
    assert code == 0, err
    report = json.loads(Path("report.json").read_text())
    last = [r for r in rows if r["step"] == 5]
    assert [{**r, "step": 5} for r in report["samples"]] == last
    # rlhf samples --eval: the last evaluation's records, the prompts with the fewest correct samples first
    code, out, err = rlhf("samples", "runs/r", "--eval", "--sort", "failing", "-n", "0", "--json")
    assert code == 0, err
    shown = [json.loads(line) for line in out.splitlines()]
    assert shown == sorted(last, key=lambda r: sum(s["correct"] for s in r["samples"]))
    code, out, err = rlhf("samples", "runs/r", "--eval", "--step", "2", "-n", "3")
    assert code == 0, err
    assert "held-out samples of step 2 of runs/r (3 of 20)" in out and "label=" in out
    code, _, err = rlhf("samples", "runs/r", "--eval", "--sort", "reward")
    assert code == 2 and "--sort reward orders training samples; held-out records (--eval) sort by failing" in err
