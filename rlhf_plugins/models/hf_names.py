"""Names transformers changed across the releases setup.cfg admits (4.56 to the newest), asked of the
model in hand rather than of a version number, so remote-code and plugin models keep theirs:

- the KV cache's argument and output field: ``past_key_values`` became ``cache`` (transformers 5.2x
  renames it with a FutureWarning; 5.40 drops the old name);
- activation checkpointing: ``is_gradient_checkpointing`` became ``is_activation_checkpointing`` and
  ``gradient_checkpointing_enable`` ``activation_checkpointing_enable`` (5.25; the old names warn, and go in 6).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def _takes_cache(cls: type) -> bool:
    try:
        return "cache" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def cache_name(model: Any) -> str:
    """The name ``model``'s forward takes its KV cache by (a PEFT model's base decides); a decode loop
    asks once."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if _takes_cache(type(base)) else "past_key_values"


def cache_argument(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` under :func:`cache_name`."""
    return {cache_name(model): cache}


def output_cache(out: Any) -> Any:
    """The KV cache a forward returned, under either name."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def checkpointing(model: Any) -> bool:
    """Whether ``model`` recomputes activations in its backward pass (gradient checkpointing)."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if flag is None else flag)


def enable_checkpointing(model: Any, kwargs: dict[str, Any] | None = None) -> None:
    """Recompute ``model``'s decoder layers in its backward pass (``torch.utils.checkpoint`` with ``kwargs``,
    non-reentrant unless they say otherwise), under the name its transformers has."""
    kwargs = {"use_reentrant": False} if kwargs is None else kwargs
    if hasattr(model, "activation_checkpointing_enable"):  # a remote-code override of the old name is still called
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
