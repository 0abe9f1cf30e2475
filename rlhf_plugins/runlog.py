"""Run directory output: metrics as JSONL and TensorBoard, a rich progress bar."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class MetricsLog:
    """``metrics.jsonl`` (one line per step) and TensorBoard scalars under ``tensorboard/``."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        self._fh = open(self.path, "a", buffering=1)
        self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        self._fh.write(json.dumps({"step": step, **clean}) + "\n")
        for key, value in clean.items():
            if math.isfinite(value):
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._fh.close()
        self._tb.close()


def _fmt(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


class StepProgress:
    """``step 12/120 ━━━━  reward 0.41  kl 0.002  loss -0.01  3.1 steps/s``."""

    def __init__(self, total: int, console: Console, enabled: bool = True) -> None:
        self.enabled = enabled
        self.console = console
        self.start = time.perf_counter()
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("reward [cyan]{task.fields[reward]}"),
            TextColumn("kl [magenta]{task.fields[kl]}"),
            TextColumn("loss [yellow]{task.fields[loss]}"),
            TextColumn("[green]{task.fields[speed]} steps/s"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            disable=not enabled,
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total, reward="-", kl="-", loss="-", speed="-")

    def __enter__(self) -> StepProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def update(self, done: int, metrics: Mapping[str, float]) -> None:
        elapsed = time.perf_counter() - self.start
        self.progress.update(
            self.task,
            completed=done,
            reward=_fmt(metrics.get("reward/mean")),
            kl=_fmt(metrics.get("kl"), 4),
            loss=_fmt(metrics.get("loss/total"), 4),
            speed=f"{done / elapsed:.2f}" if elapsed > 0 else "-",
        )
