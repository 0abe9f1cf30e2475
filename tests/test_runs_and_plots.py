"""``rlhf runs`` and ``rlhf plot``: what they read from run directories and what they draw."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.helpers import block_import, eval_rows_of, metrics_of, short_run, with_eval


@pytest.fixture
def two_runs(rlhf):
    for name, seed in (("a", "0"), ("b", "1")):
        code, _, err = rlhf("train", *with_eval("--train.run_name", name, "--train.seed", seed))
        assert code == 0, err
    return [Path("runs/a"), Path("runs/b")]


def test_plot_draws_each_default_metric_with_every_run(two_runs):
    from rlhf_plugins.commands.runs import plot_runs, read_run

    fig = plot_runs([read_run(p) for p in two_runs])
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["reward/mean", "kl", "loss/total", "completion/length", "eval/pass@1", "eval/pass@8"]
    for ax in fig.axes[:len(titles)]:
        assert [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")] == ["a", "b"]
        assert ax.get_xlabel() == "step"
    reward = fig.axes[0]
    raw_a = [line for line in reward.get_lines() if line.get_label().startswith("_")][0]  # the faint raw curve
    assert list(raw_a.get_ydata()) == [r["reward/mean"] for r in metrics_of(two_runs[0])]
    eval_line = [line for line in fig.axes[4].get_lines() if line.get_label() == "b"][0]
    assert list(eval_line.get_xdata()) == [0, 3]
    assert list(eval_line.get_ydata()) == [r["eval/pass@1"] for r in eval_rows_of(two_runs[1])]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a", "b"]


def test_rlhf_plot_writes_a_png_of_the_chosen_metrics(rlhf, two_runs):
    code, out, err = rlhf("plot", "runs", "--metrics", "reward/mean,eval/greedy", "-o", "curves.png", "--smooth", "0")
    assert code == 0, err
    import matplotlib.image

    data = Path("curves.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread("curves.png").shape
    assert width > height > 200  # two panels side by side
    assert "2 plots of 2 run(s) written to curves.png" in out


def test_smoothing_is_tensorboards_debiased_ema():
    from rlhf_plugins.commands.runs import ema

    assert ema([1.0, 1.0, 1.0], 0.6) == pytest.approx([1.0, 1.0, 1.0])  # debiased: no pull towards 0
    a = 0.5
    expected_2 = (a * (1 - a) * 2.0 + (1 - a) * 4.0) / (1 - a * a)
    assert ema([2.0, 4.0], a) == pytest.approx([2.0, expected_2])
    assert ema([3.0, 7.0], 0.0) == [3.0, 7.0]


@pytest.mark.parametrize("args, expected", [
    (["runs", "--metrics", "reward/nope"], "no run has the metric 'reward/nope'; available: "),
    (["nowhere"], "'nowhere' is not a folder; give run directories or a folder of them"),
    (["runs", "-o", "curves.jpg"], "--output 'curves.jpg' must be a .png file"),
    (["runs", "--smooth", "1"], "--smooth must be >= 0 and < 1; got 1.0"),
])
def test_plot_bad_input(rlhf, two_runs, args, expected):
    code, _, err = rlhf("plot", *args)
    assert code == 2 and err.startswith(f"rlhf: error: {expected}"), err
    assert not list(Path(".").glob("*.png"))


def test_plot_without_matplotlib_says_how_to_install_it(rlhf, two_runs, monkeypatch):
    block_import(monkeypatch, "matplotlib")
    code, _, err = rlhf("plot", "runs/a")
    assert code == 2
    assert "rlhf plot needs matplotlib; install it with: pip install 'rlhf-plugins[plot]'" in err


def test_runs_table_tells_every_status(rlhf, tmp_path):
    code, _, err = rlhf("train", *short_run("--train.run_name", "done"))
    assert code == 0, err
    stopper = tmp_path / "stopper.py"
    stopper.write_text("import os, signal\nfrom rlhf_plugins import hookimpl\n@hookimpl\n"
                       "def rlhf_after_step(step, metrics):\n    if step == 0:\n"
                       "        os.kill(os.getpid(), signal.SIGINT)\n")
    code, _, err = rlhf("train", "--plugin", str(stopper), *short_run("--train.run_name", "stopped-by-user"))
    assert code == 130, err
    failing = tmp_path / "failing.py"
    failing.write_text("def flaky(prompts, completions, step=None, **kw):\n"
                       "    import json, pathlib\n    p = pathlib.Path('calls')\n"
                       "    n = int(p.read_text()) if p.exists() else 0\n    p.write_text(str(n + 1))\n"
                       "    if n == 1:\n        raise RuntimeError('judge went away')\n"
                       "    return [0.5] * len(completions)\n")
    code, _, err = rlhf("train", "--plugin", str(failing), *short_run("--train.run_name", "broke"))
    assert code == 2 and "judge went away" in err, err
    for name, age in (("killed", 3600), ("busy", 0)):  # no summary and no status: killed, or still going
        shutil.copytree("runs/done", f"runs/{name}")
        (Path("runs") / name / "summary.json").unlink()
        then = time.time() - age
        os.utime(Path("runs") / name / "metrics.jsonl", (then, then))
    code, out, err = rlhf("runs", "--json")
    assert code == 0, err
    table = {r["run"]: r for r in json.loads(out)}
    assert {k: v["status"] for k, v in table.items()} == {
        "done": "finished", "stopped-by-user": "interrupted", "broke": "failed", "killed": "stopped", "busy": "running"}
    assert table["done"]["steps_done"] == 3 and table["done"]["steps"] == 3
    assert table["stopped-by-user"]["steps_done"] == 1 and table["broke"]["steps_done"] == 1
    status = json.loads(Path("runs/broke/status.json").read_text())
    assert status == {"status": "failed", "steps_done": 1, "message": status["message"]}
    assert "judge went away" in status["message"]
    code, out, err = rlhf("runs")
    assert code == 0 and "interrupted" in out and "3/3" in out


def test_runs_counts_a_stages_steps_as_trl_does_and_shows_names_whole(rlhf):
    """A stage's metrics count TRL's steps from 1 (its logs' global_step): 3 steps of `rlhf sft` are 3/3, not
    4; and a run's name, the key to --resume and rlhf eval, is never cut short in an 80-column table."""
    code, _, err = rlhf("sft", "--trl.max_steps", "3", "--train.run_name", "sft-on-the-default-demonstrations")
    assert code == 0, err
    code, _, err = rlhf("train", *short_run("--train.run_name", "grpo-on-the-default-task-seed-0"))
    assert code == 0, err
    code, out, err = rlhf("runs", "--json")
    assert code == 0, err
    table = {r["run"]: r for r in json.loads(out)}
    assert (table["sft-on-the-default-demonstrations"]["steps_done"],
            table["sft-on-the-default-demonstrations"]["steps"]) == (3, 3)
    code, out, err = rlhf("runs")  # stdout a pipe: rich's 80 columns
    assert code == 0, err
    assert "sft-on-the-default-demonstrations" in out and "grpo-on-the-default-task-seed-0" in out
    assert max(len(line) for line in out.splitlines()) <= 80
