"""Builtin generation backend ``transformers``: a KV-cached sampling loop in the engine's process."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._lazy import Lazy
from .._markers import hookimpl
from ..types import GenerationBackend


def starts_empty(config: Any) -> bool:
    """Under a sync that brings every weight before the first generation (broadcast, IPC), the engine
    builds its model with empty parameters instead of reading the checkpoint: under IPC its
    parameters become the learner's shared buffers, so a loaded copy would only be thrown away."""
    return config.sync.method in ("broadcast", "ipc")


@hookimpl
def rlhf_generation_backends() -> Iterable[GenerationBackend]:
    yield GenerationBackend(
        "transformers",
        factory=Lazy("rlhf_plugins.engines.transformers_engine:TransformersEngine"),
        description="sampling with the transformers model itself; no extra install",
        requires=("transformers",),
        supports_adapter=True,
        supports_shared_weights=True,
        streams_weights=True,
        memory=Lazy("rlhf_plugins.models.memory:transformers_engine_memory"),
        starts_empty=starts_empty,
    )
