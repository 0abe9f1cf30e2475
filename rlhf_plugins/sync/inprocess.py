"""``--sync.method inprocess``: the engine lives in the learner's process; tensors are copied by
name into the engine's model (dtype converted), no serialisation."""
from __future__ import annotations

from typing import Any


class InProcessSync:
    def __init__(self, config: Any) -> None:
        self.config = config

    def sync(self, actor: Any, engine: Any, step: int) -> dict[str, Any]:
        info = engine.load_weights(actor.named_weights())
        info.setdefault("rpcs", 1)
        return info
