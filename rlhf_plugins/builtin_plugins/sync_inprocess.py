"""Builtin weight sync ``inprocess``: engine and learner share a process."""
from __future__ import annotations

from typing import Iterable

from .._lazy import Lazy
from .._markers import hookimpl
from ..types import WeightSyncMethod


@hookimpl
def rlhf_weight_sync_methods() -> Iterable[WeightSyncMethod]:
    yield WeightSyncMethod(
        "inprocess",
        factory=Lazy("rlhf_plugins.sync.inprocess:InProcessSync"),
        description="copy tensors by name into the engine in the same process",
        same_process=True,
    )
