"""Builtin weight sync ``adapter``: only the LoRA adapter moves (needs LoRA on the actor and an
engine that loads adapters)."""
from __future__ import annotations

from collections.abc import Iterable

from .._lazy import Lazy
from .._markers import hookimpl
from ..types import WeightSyncMethod


@hookimpl
def rlhf_weight_sync_methods() -> Iterable[WeightSyncMethod]:
    yield WeightSyncMethod(
        "adapter",
        factory=Lazy("rlhf_plugins.sync.adapter:AdapterSync"),
        description="LoRA: only the adapter moves; vLLM generates with its LoRA support",
        requires=("peft",),
        extra="peft",
        needs_adapter=True,
    )
