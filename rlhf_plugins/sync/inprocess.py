"""``--sync.method inprocess``: the engine lives in the learner's process; tensors are copied by
name into the engine's model (dtype converted), no serialisation. Under local placement the loop
holds both objects; under ``--ray.colocate hybrid`` it holds their Ray groups, and the copy runs in
the actor that hosts both, so no weights leave that process.

In a synchronous run whose engine can point its parameters at given tensors (``share_weights``) and
whose learner trains its parameters in place (``live_weights``), the engine *shares* the learner's
parameters from set-up on: one copy of the weights in the process instead of two, and every later
sync moves nothing. Otherwise (asynchronous training, where the engine samples with an older policy;
LoRA merged for the engine; another dtype; vLLM's own fused layout) the engine keeps its own copy."""
from __future__ import annotations

from typing import Any


def copy_weights(actor: Any, engine: Any) -> dict[str, Any]:
    """The learner's weights, by name, into the engine next to it."""
    info = dict(engine.load_weights(actor.named_weights()) or {})
    info.setdefault("rpcs", 1)
    return info


def share_weights(actor: Any, engine: Any) -> bool:
    """Point the engine's parameters at the learner's live ones; False when either side cannot."""
    live = actor.live_weights()
    return live is not None and bool(engine.share_weights(live))


class InProcessSync:
    def __init__(self, config: Any) -> None:
        self.config = config
        #: the engine reads the learner's own parameters: nothing to move
        self.shared = False

    def attach(self, actor: Any, engine: Any) -> dict[str, Any]:
        """At set-up (and after a restart): share the learner's parameters when the run allows."""
        self.shared = False
        if not self.config.train.max_staleness:
            self.shared = bool(self._run(actor, engine, share_weights))
        return {"shared": self.shared}

    def sync(self, actor: Any, engine: Any, step: int) -> dict[str, Any]:
        if self.shared:
            return {"shared": True, "tensors": 0, "bytes": 0, "rpcs": 0}
        return self._run(actor, engine, copy_weights)

    @staticmethod
    def _run(actor: Any, engine: Any, fn: Any) -> Any:
        hosted_with = getattr(actor, "hosted_with", None)
        if hosted_with is not None and hosted_with(engine):
            return actor.run_with(engine, fn)
        return fn(actor, engine)
