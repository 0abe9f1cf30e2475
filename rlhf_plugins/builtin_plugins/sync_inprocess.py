"""Builtin weight sync ``inprocess``: engine and learner share a process."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._lazy import Lazy
from .._markers import hookimpl
from ..types import WeightSyncMethod
from .lora import enabled as lora_enabled


def _shares(config: Any) -> bool:
    """Synchronous runs without LoRA whose learner trains weights in the engine's dtype (float32, or
    16-bit weights beside float32 masters): the engine samples with exactly the learner's parameters."""
    same_dtype = config.model.dtype == "float32" or config.learner.master_weights
    return not config.train.max_staleness and not lora_enabled(config) and same_dtype


@hookimpl
def rlhf_weight_sync_methods() -> Iterable[WeightSyncMethod]:
    yield WeightSyncMethod(
        "inprocess",
        factory=Lazy("rlhf_plugins.sync.inprocess:InProcessSync"),
        description="the engine shares the learner's parameters (synchronous runs), else copies them by name",
        same_process=True,
        shares_weights=_shares,
    )
