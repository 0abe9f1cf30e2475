"""pytest helpers for plugin authors (and our own tests). Opt in with
``-p rlhf_plugins.testing`` or ``pytest_plugins = ["rlhf_plugins.testing"]``.

Fixtures:

* ``rlhf_pm`` -- a fresh plugin manager with the builtin plugins and no
  entry-point autoload, so installed third-party plugins cannot leak in.
* ``rlhf_hook_recorder`` -- records every hook call of ``rlhf_pm`` (registration hooks once per
  implementing plugin: the manager collects them plugin by plugin).

Helpers:

* :func:`registered` -- register a plugin for the duration of a ``with`` block;
  it is always unregistered, even when the block fails.
* :func:`backend_context` -- the context a backend factory receives, to build an engine or a
  learner directly.
* :func:`tiny_model_path` -- the cached embedded tiny Llama (built on first use).
* :func:`reduced_model_path` -- a cached random-weight model with a real vocabulary (Qwen2.5's
  151,936 tokens, tied embeddings, grouped-query attention) and two narrow layers: the shapes of
  real models, in seconds per step (:mod:`rlhf_plugins.models.shapes`).

Example::

    from rlhf_plugins import RewardFunction, hookimpl
    from rlhf_plugins.testing import registered

    class MyPlugin:
        @hookimpl
        def rlhf_reward_functions(self):
            yield RewardFunction("shout", lambda prompts, completions, **kw: [c.isupper() * 1.0 for c in completions])

    def test_registers(rlhf_pm):
        with registered(rlhf_pm, MyPlugin(), "mine"):
            assert "shout" in rlhf_pm.components.names(RewardFunction)
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .core.manager import RLHFPluginManager, create_manager
from .protocols import BackendContext

try:  # the helpers work without pytest; the fixtures need it
    import pytest
except ImportError:  # pragma: no cover - exercised in a subprocess test
    pytest = None  # type: ignore[assignment]


@contextlib.contextmanager
def registered(pm: RLHFPluginManager, plugin: object, name: str | None = None) -> Iterator[object]:
    """Register ``plugin`` on ``pm`` inside the block; always unregister it after."""
    pm.register(plugin, name)
    try:
        yield plugin
    finally:
        if pm.is_registered(plugin):
            pm.unregister(plugin)
        elif name is not None and pm.has_plugin(name):
            pm.unregister(name=name)


@dataclass
class HookRecorder:
    """Every hook call made through ``pm.hook`` while recording: ``(hook name, kwargs)``."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def of(self, hook: str) -> list[dict[str, Any]]:
        return [kwargs for name, kwargs in self.calls if name == hook]


@contextlib.contextmanager
def record_hooks(pm: RLHFPluginManager) -> Iterator[HookRecorder]:
    """Record the hook calls of ``pm`` inside the block (pluggy's hook-call monitoring)."""
    recorder = HookRecorder()

    def before(hook_name: str, hook_impls: Any, kwargs: dict[str, Any]) -> None:
        recorder.calls.append((hook_name, dict(kwargs)))

    def after(outcome: Any, hook_name: str, hook_impls: Any, kwargs: dict[str, Any]) -> None:
        pass

    undo = pm.add_hookcall_monitoring(before, after)
    try:
        yield recorder
    finally:
        undo()


def backend_context(config: Any, role: str, model_path: str, pm: RLHFPluginManager | None = None,
                    **extra: Any) -> BackendContext:
    """The context a backend factory receives, for calling a factory directly in a test:
    ``TransformersEngine(backend_context(config, "generation", path, pm))``."""
    pm = pm or create_manager(autoload=False)
    return BackendContext(config, role, model_path, lambda: pm.load_model(role, model_path, config), **extra)


def tiny_model_path() -> str:
    from .models.tiny_model import default_model_path

    return default_model_path(quiet=True)


def reduced_model_path(shape: str = "qwen2.5-0.5b", layers: int = 2, hidden: int = 128) -> str:
    """A cached random-weight model of ``shape`` reduced to ``layers`` x ``hidden`` (real vocabulary,
    head size and tying kept), with the embedded tokenizer beside it."""
    from .models.shapes import build
    from .models.tiny_model import cached_build

    return cached_build(f"{shape}-{layers}x{hidden}-v1",
                        lambda out: build(shape, out, layers=layers, hidden=hidden, dtype="float32"), quiet=True)


if pytest is not None:

    @pytest.fixture
    def rlhf_pm() -> RLHFPluginManager:
        """A fresh manager: builtin plugins only, no entry-point autoload."""
        return create_manager(autoload=False)


    @pytest.fixture
    def rlhf_hook_recorder(rlhf_pm: RLHFPluginManager) -> Iterator[HookRecorder]:
        with record_hooks(rlhf_pm) as recorder:
            yield recorder
