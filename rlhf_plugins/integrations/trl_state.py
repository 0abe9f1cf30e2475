"""What TRL scripts read from a trainer after ``train()``: the ``TrainOutput`` it returns and
``trainer.state`` with its ``log_history``, made from a finished run directory."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainerStateView:
    """The fields of transformers' ``TrainerState`` that scripts read after training."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    log_history: list[dict[str, Any]] = field(default_factory=list)


def _rows(run_dir: Path | None) -> list[dict[str, Any]]:
    if run_dir is None or not (run_dir / "metrics.jsonl").is_file():
        return []
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def trainer_state(run_dir: Path | None, raw: dict[str, Any]) -> TrainerStateView:
    rows = [r for r in _rows(run_dir) if "reward/mean" in r]
    history = [{**r, "step": int(r.get("step", i)) + 1, "loss": r.get("loss/total"), "reward": r.get("reward/mean")}
               for i, r in enumerate(rows)]
    return TrainerStateView(len(rows), int(raw.get("train", {}).get("steps", len(rows))), 0.0, history)


def train_output(run_dir: Path) -> Any:
    """transformers' ``TrainOutput(global_step, training_loss, metrics)`` of a finished run."""
    from transformers.trainer_utils import TrainOutput

    rows = [r for r in _rows(run_dir) if "reward/mean" in r]
    losses = [r["loss/total"] for r in rows if r.get("loss/total") is not None]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    metrics = {"train_loss": sum(losses) / len(losses) if losses else 0.0, "run_dir": str(run_dir),
               **{k: v for k, v in summary.items() if isinstance(v, (int, float))}}
    return TrainOutput(len(rows), metrics["train_loss"], metrics)
