"""Extending a builtin backend without losing what it can do.

A plugin that changes one thing about a builtin engine, learner or sync method wraps it: it takes
the builtin's registration (:func:`builtin`), keeps its declared capabilities (adapter support,
shared weights, memory model, process rules) by deriving a new registration from it, and wraps
the object the builtin factory makes in a :class:`Delegate`, which forwards every attribute the
wrapper does not define. Optional methods are found by presence (``getattr``), so a plain wrapper
class would silently drop them (``--sync.verify`` would then say the engine has no
``logprobs()``); a :class:`Delegate` keeps them::

    from rlhf_plugins import GenerationBackend, hookimpl
    from rlhf_plugins.extending import Delegate, builtin, derive

    class CountingEngine(Delegate):
        calls = 0

        def generate(self, prompt_ids, params):
            CountingEngine.calls += 1
            return self.inner.generate(prompt_ids, params)

    @hookimpl
    def rlhf_generation_backends():
        yield derive(builtin(GenerationBackend, "transformers"), "counting", CountingEngine)

``examples/extending_builtins.py`` wraps an engine, a learner and a sync method this way, and a
test trains with all three.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from ._lazy import resolve
from .errors import ConfigError
from .types import AREAS, Component

C = TypeVar("C", bound=Component)


def builtin(cls: type[C], name: str) -> C:
    """The component rlhf-plugins itself registers as ``name`` in the area of ``cls`` (e.g.
    ``builtin(GenerationBackend, "vllm")``), whatever else is installed."""
    from .builtin_plugins import DEFAULT_PLUGINS

    hook = next(h for h, area_cls in AREAS.items() if area_cls is cls)
    found = []
    for modname in DEFAULT_PLUGINS:
        register = getattr(importlib.import_module(modname), hook, None)
        if register is not None:
            found += [c for c in register() if c.name == name]
    if not found:
        raise ConfigError(f"rlhf-plugins has no builtin {cls.area} named '{name}'")
    return found[0]


def derive(base: C, name: str, wrap: Callable[[Any], Any], description: str = "") -> C:
    """A registration named ``name`` with every capability of ``base``, whose factory builds the
    base's object and returns ``wrap(that object)``."""
    return dataclasses.replace(base, name=name, factory=_Wrapped(base.factory, wrap),  # type: ignore[call-arg]
                               description=description or f"{base.description} (wrapped: {name})")


class _Wrapped:
    """A factory: the base factory's object, wrapped (picklable, for Ray workers)."""

    def __init__(self, factory: Any, wrap: Callable[[Any], Any]) -> None:
        self.factory, self.wrap = factory, wrap

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrap(resolve(self.factory)(*args, **kwargs))


class Delegate:
    """A wrapper that forwards every attribute it does not define to ``inner``: methods the
    wrapper overrides run instead (call ``self.inner`` for the original), the others -- optional
    ones included -- are the wrapped object's own."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
