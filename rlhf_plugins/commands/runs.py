"""``rlhf runs`` (a table of the runs in a folder) and ``rlhf plot`` (their curves as a PNG).

Both read only what a run directory holds -- ``config.yaml``, ``metrics.jsonl``,
``summary.json``, ``status.json``, ``best.json`` -- so they work on runs from any machine, and
while a run is still going.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from ..errors import UsageError

#: curves ``rlhf plot`` draws when --metrics is not given (those a run has)
DEFAULT_METRICS = ("reward/mean", "kl", "loss/total", "completion/length", "eval/pass@1", "eval/pass@{k}")
#: a run whose metrics.jsonl changed this recently, without a summary or status, is running
RUNNING_WITHIN_S = 120.0


def add_parser(sub: Any, plugin_args: Any) -> None:
    runs = sub.add_parser("runs", allow_abbrev=False, help="list runs: status, steps, reward gain, best evaluation",
                          description="A table of the run directories under DIR (default: runs): status (finished, "
                                      "interrupted, failed, running, stopped), steps done, reward gain, best held-out "
                                      "pass@1, seconds per step.")
    runs.add_argument("dir", nargs="?", default="runs", help="a folder of run directories (default: runs)")
    runs.add_argument("--json", action="store_true", help="machine-readable output")
    plot = sub.add_parser("plot", allow_abbrev=False, help="plot the curves of one or more runs into a PNG",
                          description="Plot metrics of one or more runs (overlaid, with a legend) into a PNG: by "
                                      "default reward, KL, loss, completion length and the held-out evaluation.")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or folders of them)")
    plot.add_argument("--metrics", help="comma-separated metric names (e.g. reward/mean,kl,eval/pass@1)")
    plot.add_argument("-o", "--output", default="plot.png", help="the PNG to write (default: plot.png)")
    plot.add_argument("--smooth", type=float, default=0.6,
                      help="exponential smoothing of step metrics, 0 (none) to below 1 (default: 0.6, as TensorBoard)")


def run(args: argparse.Namespace, rest: list[str], console: Console) -> int:
    if rest:
        raise UsageError(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "runs":
        return cmd_runs(args, console)
    return cmd_plot(args, console)


# --- reading run directories ----------------------------------------------------------------

@dataclass
class RunInfo:
    path: Path
    status: str
    steps_done: int
    steps_total: int | None
    rows: list[dict[str, Any]] = field(repr=False)
    evals: list[dict[str, Any]] = field(repr=False)
    summary: dict[str, Any] = field(default_factory=dict, repr=False)
    best: dict[str, Any] | None = None

    @property
    def reward_gain(self) -> float | None:
        if "reward_gain" in self.summary:
            return float(self.summary["reward_gain"])
        rewards = [r["reward/mean"] for r in self.rows if r.get("reward/mean") is not None]
        if not rewards:
            return None
        k = max(1, len(rewards) // 10)
        return sum(rewards[-k:]) / k - sum(rewards[:k]) / k

    @property
    def seconds_per_step(self) -> float | None:
        times = [r["time/step"] for r in self.rows if r.get("time/step") is not None]
        return sum(times) / len(times) if times else None

    @property
    def best_pass_at_1(self) -> float | None:
        values = [r["eval/pass@1"] for r in self.evals if r.get("eval/pass@1") is not None]
        return max(values) if values else None


def is_run_dir(path: Path) -> bool:
    return (path / "config.yaml").is_file() and (path / "metrics.jsonl").exists()


def read_run(path: Path) -> RunInfo:
    import yaml

    from ..training.runlog import is_eval_row, read_metrics

    all_rows = read_metrics(path / "metrics.jsonl")
    rows = [r for r in all_rows if not is_eval_row(r)]
    evals = [r for r in all_rows if is_eval_row(r)]
    try:
        config = yaml.safe_load((path / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        config = {}
    stage = isinstance(config.get("trl"), dict)  # rlhf sft / rm / dpo: TRL's steps, counted from 1 in its logs
    section, key = ("trl", "max_steps") if stage else ("train", "steps")
    try:
        total: int | None = int((config.get(section) or {}).get(key))
    except (AttributeError, TypeError, ValueError):
        total = None
    if total is not None and total <= 0:  # TRL's -1: as many as its epochs make
        total = None
    summary = _json(path / "summary.json") or {}
    status_file = _json(path / "status.json")
    if summary:
        status = "finished"
    elif status_file:
        status = str(status_file.get("status", "stopped"))
    else:
        age = time.time() - (path / "metrics.jsonl").stat().st_mtime
        status = "running" if age < RUNNING_WITHIN_S else "stopped"
    done = max((int(r["step"]) + (0 if stage else 1) for r in rows if "step" in r), default=0)
    if stage and isinstance(summary.get("steps"), int):  # its last log may come before its last step
        done = summary["steps"]
    return RunInfo(path, status, done, total, rows, evals, summary, _json(path / "best.json"))


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def find_runs(paths: list[str]) -> list[Path]:
    """Run directories named, or found one level below the folders named."""
    found: list[Path] = []
    for name in paths:
        path = Path(name).expanduser()
        if not path.is_dir():
            raise UsageError(f"'{name}' is not a folder; give run directories or a folder of them")
        if is_run_dir(path):
            found.append(path)
        else:
            inner = sorted(p for p in path.iterdir() if p.is_dir() and is_run_dir(p))
            if not inner:
                raise UsageError(f"'{name}' is not a run directory and holds none (a run has config.yaml and "
                                 "metrics.jsonl)")
            found += inner
    return found


# --- rlhf runs -------------------------------------------------------------------------------------

def cmd_runs(args: argparse.Namespace, console: Console) -> int:
    base = Path(args.dir).expanduser()
    if not base.is_dir():
        raise UsageError(f"'{args.dir}' is not a folder; give the folder your runs are in (--train.output_dir)")
    runs = [read_run(p) for p in sorted(base.iterdir()) if p.is_dir() and is_run_dir(p)]
    if args.json:
        print(json.dumps([{"run": r.path.name, "status": r.status, "steps_done": r.steps_done,
                           "steps": r.steps_total, "reward_gain": r.reward_gain,
                           "best_eval_pass@1": r.best_pass_at_1, "seconds_per_step": r.seconds_per_step}
                          for r in runs], indent=2))
        return 0
    from rich.table import Table

    colours = {"finished": "green", "running": "cyan", "interrupted": "yellow", "failed": "red", "stopped": "red"}
    table = Table(title=f"runs in {escape(str(base))}")
    # a run's name whole (the key to --resume, rlhf eval, rlhf plot): the other columns' headers wrap instead
    table.add_column("run", no_wrap=True, min_width=min(48, max((len(r.path.name) for r in runs), default=3)))
    for col, justify in (("status", "left"), ("steps", "right"), ("reward gain", "right"),
                         ("best eval pass@1", "right"), ("s/step", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in runs:
        steps = f"{r.steps_done}/{r.steps_total}" if r.steps_total else str(r.steps_done)
        table.add_row(escape(r.path.name), f"[{colours.get(r.status, 'white')}]{r.status}[/]", steps,
                      _num(r.reward_gain, "+.3f"), _num(r.best_pass_at_1, ".3f"), _num(r.seconds_per_step, ".2f"))
    console.print(table if runs else f"no runs in {escape(str(base))}")
    return 0


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


# --- rlhf plot -------------------------------------------------------------------------------------

def cmd_plot(args: argparse.Namespace, console: Console) -> int:
    if not 0 <= args.smooth < 1:
        raise UsageError(f"--smooth must be >= 0 and < 1; got {args.smooth}")
    out = Path(args.output).expanduser()
    if out.suffix.lower() != ".png":
        raise UsageError(f"--output '{args.output}' must be a .png file")
    if not out.parent.is_dir():
        raise UsageError(f"cannot write '{out}': no such folder; choose another --output")
    runs = [read_run(p) for p in find_runs(args.runs)]
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    fig = plot_runs(runs, metrics, args.smooth)
    tmp = out.with_name(out.stem + ".tmp.png")
    try:
        fig.savefig(tmp, dpi=110)
        tmp.replace(out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write '{out}': {exc.strerror or exc}; choose another --output") from exc
    console.print(f"{len(fig.axes)} plots of {len(runs)} run(s) written to {escape(str(out))}", highlight=False)
    return 0


def _matplotlib() -> Any:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("rlhf plot needs matplotlib; install it with: pip install 'rlhf-plugins[plot]'")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def chosen_metrics(runs: list[RunInfo], metrics: list[str] | None) -> list[str]:
    """The metrics to draw: those asked for (each must exist in some run), else the defaults the
    runs have."""
    present = {k for r in runs for row in r.rows + r.evals for k in row if k not in ("step", "nonfinite")}
    if metrics:
        missing = [m for m in metrics if m not in present]
        if missing:
            raise UsageError(f"no run has the metric '{missing[0]}'; available: {', '.join(sorted(present))}")
        return metrics
    out = []
    for name in DEFAULT_METRICS:
        if name == "eval/pass@{k}":
            out += sorted(k for k in present if k.startswith("eval/pass@") and k != "eval/pass@1")[:1]
        elif name in present:
            out.append(name)
    return out


def ema(values: list[float], alpha: float) -> list[float]:
    """TensorBoard's smoothing: each point is ``alpha * previous + (1 - alpha) * value``, debiased
    at the start."""
    out, last, weight = [], 0.0, 0.0
    for v in values:
        last = alpha * last + (1 - alpha) * v
        weight = alpha * weight + (1 - alpha)
        out.append(last / weight if weight else v)
    return out


def plot_runs(runs: list[RunInfo], metrics: list[str] | None = None, smooth: float = 0.6) -> Any:
    """A figure with one panel per metric, every run overlaid (legend: the run's folder name).
    Step metrics are smoothed (the raw curve faint behind); evaluations are points."""
    plt = _matplotlib()
    names = chosen_metrics(runs, metrics)
    if not names:
        raise UsageError("the runs have no metrics yet")
    cols = min(3, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes.flat, names):
        for i, run in enumerate(runs):
            source = run.evals if name.startswith("eval/") else run.rows
            points = [(r["step"], r[name]) for r in source if r.get(name) is not None]
            if not points:
                continue
            xs, ys = zip(*points)
            colour = colours[i % len(colours)]
            if name.startswith("eval/"):
                ax.plot(xs, ys, marker="o", color=colour, label=run.path.name)
            elif smooth > 0:
                ax.plot(xs, ys, color=colour, alpha=0.25, linewidth=0.8)
                ax.plot(xs, ema(list(ys), smooth), color=colour, label=run.path.name)
            else:
                ax.plot(xs, ys, color=colour, label=run.path.name)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), frameon=False)
    fig.tight_layout(rect=(0, 0.06 if handles else 0, 1, 1))
    return fig
