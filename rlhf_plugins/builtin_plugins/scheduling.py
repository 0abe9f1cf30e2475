"""Builtin scheduling of asynchronous rollouts: admit a rollout as soon as the staleness bound allows."""
from __future__ import annotations

from .._markers import hookimpl


@hookimpl(trylast=True)
def rlhf_admit_rollout(step: int, learner_version: int, engine_version: int, queued: list[int],
                       max_staleness: int) -> bool:
    return learner_version >= step - max_staleness
