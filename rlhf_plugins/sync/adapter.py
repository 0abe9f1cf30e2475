"""``--sync.method adapter``: only the LoRA adapter moves to the engine (vLLM generates with its
LoRA support; the transformers engine wraps itself with PEFT). Both ends live here: the actor's
ranks hand over the adapter (``adapter_state``, collective under ZeRO-3), every engine loads it
(``load_adapter``)."""
from __future__ import annotations

from typing import Any

from ..errors import UsageError
from ..protocols import RankContext


def _adapter_state(ctx: RankContext) -> tuple[dict[str, Any], dict[str, Any]]:
    get = getattr(ctx.backend, "adapter_state", None)
    if not callable(get):
        raise UsageError(f"learner '{type(ctx.backend).__name__}' has no adapter_state(), which --sync.method "
                         "adapter needs; use another --sync.method")
    return get()


def _load_adapter(ctx: RankContext, weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    load = getattr(ctx.backend, "load_adapter", None)
    if not callable(load):
        raise UsageError(f"generation engine '{type(ctx.backend).__name__}' cannot load LoRA adapters "
                         "(no load_adapter()); use another --sync.method")
    return load(weights, config)


def load_into(engine: Any, weights: dict[str, Any], config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every engine of a generation role loads this adapter (PEFT's saved names and config)."""
    return engine.run(_load_adapter, weights, config)


class AdapterSync:
    def __init__(self, config: Any) -> None:
        self.config = config

    def sync(self, actor: Any, engine: Any, step: int) -> dict[str, Any]:
        weights, cfg = actor.run(_adapter_state)[0]
        infos = load_into(engine, weights, cfg)
        return {"tensors": infos[0].get("tensors", len(weights)), "rpcs": 1 + len(infos),
                "bytes": sum(t.numel() * t.element_size() for t in weights.values())}
