"""In-process weight sync: the engine lives in the learner's process; tensors are
copied by name into the engine's model (dtype converted), no serialisation."""
from __future__ import annotations

import time
from typing import Any


class InProcessSync:
    def __init__(self, config: Any) -> None:
        self.config = config

    def sync(self, actor: Any, engine: Any, step: int) -> dict[str, Any]:
        start = time.perf_counter()
        info = engine.load_weights(actor.named_weights())
        info.update(method="inprocess", rpcs=1, seconds=time.perf_counter() - start)
        return info
