"""Run directory output: the directory itself, metrics as JSONL and TensorBoard, a rich progress bar,
and quiet third-party libraries."""
from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ..errors import ConfigError


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (a torn last line, from a killed run, is skipped)."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


#: metrics that measure the machine (seconds, rates, memory), not the training: they differ between two
#: runs that are otherwise identical (a resumed run and an uninterrupted one)
MEASURED = ("time/", "throughput/", "memory/")


def is_eval_row(row: Mapping[str, Any]) -> bool:
    """A ``metrics.jsonl`` row of a held-out evaluation (its ``step``: updates the policy had)."""
    return any(k.startswith("eval/") for k in row)


class MetricsLog:
    """``metrics.jsonl`` (one line per step) and TensorBoard scalars under ``tensorboard/``.

    Evaluations are rows of their own, at the number of updates the evaluated policy had.
    ``start_step`` continues a run: lines of steps at or after it (written after the checkpoint
    being resumed; an evaluation at exactly ``start_step`` is of the resumed policy and stays) are
    dropped, and TensorBoard purges its events from that step on, so both
    continue with no duplicated and no missing step. Non-finite values are written as ``null``
    and listed under ``nonfinite`` (the file stays valid JSON)."""

    def __init__(self, run_dir: Path, start_step: int = 0) -> None:
        self.run_dir = run_dir
        self._open(start_step)

    def rewind(self, start_step: int) -> None:
        """Continue from ``start_step`` again (after going back to a checkpoint mid-run)."""
        self.close()
        self._open(start_step)

    def _open(self, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        run_dir = self.run_dir
        self.path = run_dir / "metrics.jsonl"
        self.kept = _continue(self.path, start_step, lambda r: r.get("step", -1) < start_step or (
            r.get("step") == start_step and is_eval_row(r)))
        for name, kept_before in ROW_LOGS.items():
            _continue(run_dir / name, start_step, lambda r, kept_before=kept_before: kept_before(r, start_step))
        self._fh = open(self.path, "a", buffering=1)
        self._rows: dict[str, Any] = {}  # the ROW_LOGS files written so far
        self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step or None)

    def log(self, step: int, metrics: Mapping[str, float], samples: list[dict[str, Any]] | None = None) -> None:
        """A step's metrics, and its samples' rows (``train.log_samples_every``) in ``samples.jsonl``."""
        if samples:
            self.rows("samples.jsonl", samples)
        values = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        bad = sorted(k for k, v in values.items() if not math.isfinite(v))
        row: dict[str, Any] = {"step": step, **{k: (None if k in bad else v) for k, v in values.items()}}
        if bad:
            row["nonfinite"] = bad
        self._fh.write(json.dumps(row) + "\n")
        for key, value in values.items():
            if key not in bad:
                self._tb.add_scalar(key, value, step)

    def rows(self, name: str, rows: list[dict[str, Any]]) -> None:
        """``rows`` appended to the run's ``name`` (one of :data:`ROW_LOGS`), opened by its first rows."""
        if name not in self._rows:
            self._rows[name] = open(self.run_dir / name, "a", buffering=1)
        self._rows[name].write("".join(json.dumps(r, default=str) + "\n" for r in rows))

    def close(self) -> None:
        self._fh.close()
        for fh in self._rows.values():
            fh.close()
        self._tb.close()


#: a run's logs of rows besides metrics.jsonl, and which rows a run continuing from a step keeps: the
#: samples of the steps before it, the evaluations up to it (one at that step is of the policy resumed)
ROW_LOGS = {"samples.jsonl": lambda row, start: row.get("step", -1) < start,
            "eval_samples.jsonl": lambda row, start: row.get("step", -1) <= start}


def _continue(path: Path, start_step: int, keep: Any) -> list[dict[str, Any]]:
    """A run's ``.jsonl`` log as it continues from ``start_step``: the rows ``keep`` keeps, the file rewritten
    to hold only them; a new run (``start_step`` 0) removes a file left by an earlier one."""
    if start_step <= 0 or not path.exists():
        path.unlink(missing_ok=True)
        return []
    kept = [r for r in read_metrics(path) if keep(r)]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)
    return kept


def _fmt(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


#: (label, metric, digits, colour) of the values an RL run's progress shows
RL_COLUMNS = (("reward", "reward/mean", 3, "cyan"), ("kl", "kl", 4, "magenta"), ("loss", "loss/total", 4, "yellow"))


class StepProgress:
    """``step 12/120 ━━━━  reward 0.41  kl 0.002  loss -0.01  3.1 steps/s  mem 1.2G actor`` on a terminal
    (``mem``: the largest peak resident set of a role's process so far; ``columns``: which values, an RL
    run's by default, a stage's its own); in a job log or a pipe (not a terminal), a plain line about
    every 5% of the run or 30 s instead of a bar."""

    def __init__(self, total: int, console: Console, enabled: bool = True, start: int = 0,
                 every_seconds: float = 30.0, columns: tuple[tuple[str, str, int, str], ...] = RL_COLUMNS) -> None:
        self.total = total
        self.columns = columns
        self.console = console
        self.live = enabled and console.is_terminal
        self.plain = enabled and not console.is_terminal
        self.start = self.last_time = time.perf_counter()
        self.first = self.last_line = start
        self.every_steps = max(1, total // 20)
        self.every_seconds = every_seconds
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            *(TextColumn(f"{label} [{colour}]{{task.fields[c{i}]}}") for i, (label, *_, colour) in enumerate(columns)),
            TextColumn("[green]{task.fields[speed]} steps/s"),
            TextColumn("mem {task.fields[memory]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[phase]}"),
            console=console,
            disable=not self.live,
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, speed="-", memory="-", phase="",
                                           **{f"c{i}": "-" for i in range(len(columns))})

    def __enter__(self) -> StepProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def update(self, done: int, metrics: Mapping[str, float], samples: list[dict[str, Any]] | None = None) -> None:
        """The bar (or a line) after step ``done``; ``samples``: rows printed as a table (``train.print_samples``)."""
        now = time.perf_counter()
        rate = (done - self.first) / (now - self.start) if now > self.start else 0.0
        from .memory_watch import largest

        values = {f"c{i}": _fmt(metrics.get(key), digits) for i, (_, key, digits, _) in enumerate(self.columns)}
        speed, memory = f"{rate:.2f}" if rate else "-", largest(metrics)
        self.progress.update(self.task, completed=done, speed=speed, memory=memory, **values)
        due = done - self.last_line >= self.every_steps or now - self.last_time >= self.every_seconds
        if self.plain and (due or done == self.total) and done != self.last_line:  # each step's line once
            eta = (self.total - done) / rate if rate else 0.0
            shown = " ".join(f"{label} {values[f'c{i}']}" for i, (label, *_) in enumerate(self.columns))
            self.console.print(f"step {done}/{self.total} {shown} {speed} steps/s eta {_clock(eta)} "
                               f"mem {memory}", highlight=False, soft_wrap=True)
            self.last_line, self.last_time = done, now
        if samples:
            from ..tables import print_samples

            print_samples(self.console, samples, f"step {done}/{self.total}")

    def phase(self, text: str) -> None:
        """A note after the bar (``eval 12/20``) while something other than a step runs."""
        self.progress.update(self.task, phase=text)


class TaskProgress:
    """A transient ``LABEL 12/20 UNIT`` bar on a terminal, for work outside the step bar; silent
    elsewhere (the caller prints its result)."""

    def __init__(self, console: Console | None, label: str, unit: str) -> None:
        self.live = console is not None and console.is_terminal
        self.progress = Progress(TextColumn(f"[bold]{label}"), MofNCompleteColumn(), BarColumn(), TextColumn(unit),
                                 TimeElapsedColumn(), console=console, disable=not self.live, transient=True)
        self.task = self.progress.add_task(label, total=None)

    def __enter__(self) -> TaskProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def __call__(self, done: int, total: int) -> None:
        self.progress.update(self.task, completed=done, total=total)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def quiet_libraries() -> None:
    import os

    import torch
    import transformers

    if not torch.cuda.is_available():  # DeepSpeed (pulled in by transformers) would probe and warn
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def runs_inside(folder: Path) -> str:
    """``; it holds run directories (a, b, c, ...)`` for a folder of runs given where one run is expected."""
    runs = sorted(p.name for p in folder.iterdir() if (p / "config.yaml").is_file()) if folder.is_dir() else []
    return f"; it holds run directories ({', '.join(runs[:3])}{', ...' if len(runs) > 3 else ''})" if runs else ""


def make_run_dir(output_dir: str, run_name: str | None, prefix: str) -> Path:
    """``output_dir/run_name``, or ``output_dir/<prefix>-<date>-<time>`` (suffixed when taken)."""
    base = Path(output_dir).expanduser()
    name = run_name or f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = base / name
    if run_dir.exists():
        if run_name:
            raise ConfigError(f"run directory '{run_dir}' already exists; choose another --train.run_name "
                              f"or continue it with --resume {run_dir}")
        suffix = 1
        while (base / f"{name}-{suffix}").exists():
            suffix += 1
        run_dir = base / f"{name}-{suffix}"
    try:
        run_dir.mkdir(parents=True)
        (run_dir / ".write-test").write_text("")
        (run_dir / ".write-test").unlink()
    except OSError as exc:
        if run_dir.is_dir():
            run_dir.rmdir()
        raise ConfigError(f"cannot create the run directory '{run_dir}': {exc.strerror or exc}; choose another "
                          "--train.output_dir") from exc
    return run_dir
