"""Builtin placement ``local``: every role in this process."""
from __future__ import annotations

from collections.abc import Iterable

from .._lazy import Lazy
from .._markers import hookimpl
from ..types import PlacementStrategy


@hookimpl
def rlhf_placement_strategies() -> Iterable[PlacementStrategy]:
    yield PlacementStrategy(
        "local",
        factory=Lazy("rlhf_plugins.placement.local:LocalPlacement"),
        description="every role in this process (laptop, single GPU, tests)",
        node_memory=Lazy("rlhf_plugins.models.memory:this_machine"),
    )
