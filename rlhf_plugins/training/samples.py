"""What the policy wrote and what it got for it: every ``train.log_samples_every``-th step's samples as rows
of ``<run>/samples.jsonl`` (verl's rollout_data_dir, TRL's log_completions) -- the prompt, the completion,
each reward's score, the combined score before and after shaping, the advantage, how it ended and the
dataset's plain columns (a label, an answer) -- and the first ``train.print_samples`` of them printed as a
table (TRL's num_completions_to_print; :mod:`rlhf_plugins.tables`). ``MetricsLog`` writes the rows; a resumed
run drops those of the steps it does again, as in ``metrics.jsonl``. Observers get them through the
``rlhf_after_samples`` hook (the builtin W&B and MLflow trackers log them as a table)."""
from __future__ import annotations

import math
from typing import Any

import torch

from ..tables import PLAIN
from .rollout import Rollout


def due_rows(every: int, step: int, rollout: Rollout, batch: dict[str, Any]) -> list[dict[str, Any]]:
    """The step's rows when it is one of every ``every``-th (the first step's too); none otherwise."""
    return sample_rows(step, rollout, batch) if every and step % every == 0 else []


def sample_rows(step: int, rollout: Rollout, batch: dict[str, Any]) -> list[dict[str, Any]]:
    """A row per sample of a step's rollout; ``batch`` holds its ``advantages`` (each sample's is the mean
    over its completion tokens) and ``action_mask``."""
    mask = batch["action_mask"].to(torch.float64)
    counts = mask.sum(-1)
    advantages = ((batch["advantages"].to(torch.float64) * mask).sum(-1) / counts.clamp_min(1)).tolist()
    tokens = counts.long().tolist()
    columns = {k: v for k, v in rollout.columns.items() if all(isinstance(x, PLAIN) for x in v)}
    raw = rollout.raw_scores or rollout.scores
    shaped = rollout.scores != raw
    rows = []
    for i in range(len(rollout)):
        row = {"step": step, "group": i // max(1, rollout.group_size), "prompt": rollout.prompts[i],
               "completion": rollout.completions[i], "reward": _number(raw[i]),
               "rewards": {name: _number(v[i]) for name, v in rollout.reward_components.items()},
               "advantage": _number(advantages[i]), "tokens": tokens[i],
               "finish_reason": rollout.finish_reasons[i], "columns": {k: v[i] for k, v in columns.items()}}
        if shaped:
            row["score"] = _number(rollout.scores[i])
        if rollout.extra:  # what reward functions added with TRL's log_extra (as text unless plain)
            row["extra"] = {k: v[i] if isinstance(v[i], PLAIN) else str(v[i]) for k, v in rollout.extra.items()}
        rows.append(row)
    return rows


def _number(value: float | None) -> float | None:
    """A score as JSON holds it: None for an abstention or a value that is not finite."""
    return None if value is None or not math.isfinite(value) else float(value)
