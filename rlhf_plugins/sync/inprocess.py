"""``--sync.method inprocess``: the engine lives in the learner's process; tensors are copied by
name into the engine's model (dtype converted), no serialisation. Under local placement the loop
holds both objects; under ``--ray.colocate hybrid`` it holds their Ray groups, and the copy runs in
the actor that hosts both, so no weights leave that process."""
from __future__ import annotations

from typing import Any


def copy_weights(actor: Any, engine: Any) -> dict[str, Any]:
    """The learner's weights, by name, into the engine next to it."""
    info = dict(engine.load_weights(actor.named_weights()) or {})
    info.setdefault("rpcs", 1)
    return info


class InProcessSync:
    def __init__(self, config: Any) -> None:
        self.config = config

    def sync(self, actor: Any, engine: Any, step: int) -> dict[str, Any]:
        hosted_with = getattr(actor, "hosted_with", None)
        if hosted_with is not None and hosted_with(engine):
            return actor.run_with(engine, copy_weights)
        return copy_weights(actor, engine)
