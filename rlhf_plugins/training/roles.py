"""The roles of the RL loop as ordinary classes.

A placement plugin decides where each one lives: constructed right here (local placement) or
once per rank inside Ray actors; the training loop calls the same methods either way. Each role
rebuilds the plugin manager from a :class:`PluginSpec` in its own process, so model-loading hooks
(PEFT, custom architectures) apply everywhere, and builds its backend from the component the
driver resolved (``factory(BackendContext)``).

Besides their own methods, roles offer the generic calls of :class:`rlhf_plugins.RoleHandle`
(``run`` and ``endpoints``): sync methods and plugins run their own functions beside a backend
through them, so no role has a method named after a sync method.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from .._lazy import resolve
from ..core.manager import get_manager
from ..core.spec import PluginSpec
from ..dispatch import dispatch
from ..errors import PluginError, UsageError
from ..protocols import OPTIONAL, BackendContext, GenerationEngine, Learner, RankContext, missing_methods
from ..types import Component, GenerationBackend, LearnerBackend
from . import host_memory

if TYPE_CHECKING:
    import torch


def rank_and_world() -> tuple[int, int]:
    """This process's rank in its role, as the placement set it (torch.distributed's env:// variables)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class Role:
    """Base of every role: the generic ``run`` / ``endpoints`` for the rank in this process.

    A placement with several ranks calls ``call_function(fn, args)`` on each rank's object to
    implement ``run`` and its endpoints; with one rank (local) the object is its own handle."""

    role = "role"
    backend: Any = None

    def _rank_context(self) -> RankContext:
        ctx = self.__dict__.get("_ctx")
        if ctx is None:
            rank, world = rank_and_world()
            ctx = self._ctx = RankContext(self.backend, self.role, rank, world)
        return ctx

    def call_function(self, fn: Callable[..., Any], args: tuple = ()) -> Any:
        return fn(self._rank_context(), *args)

    def run(self, fn: Callable[..., Any], *args: Any, rank: int | None = None) -> Any:
        out = self.call_function(fn, args)
        return [out] if rank is None else out

    def endpoints(self) -> list[LocalEndpoint]:
        return [LocalEndpoint(self)]

    def shutdown(self) -> None:
        stop = getattr(self.backend, "shutdown", None)
        if callable(stop):
            stop()


class LocalEndpoint:
    """The endpoint of a role in this process: calls run at once, handles are the results."""

    def __init__(self, role: Role) -> None:
        self.target = role

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.target.call_function(fn, args)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.target.call_function(fn, args)

    @staticmethod
    def wait(handles: list[Any]) -> list[Any]:
        return list(handles)


def build_backend(component: Component, contract: type, ctx: BackendContext, provider: str) -> Any:
    """``factory(ctx)``, checked against its contract: a missing required method is one line
    naming the plugin, before the first step."""
    obj = resolve(component.factory)(ctx)
    missing = missing_methods(obj, contract)
    if missing:
        raise PluginError(
            f"{component.area} '{component.name}' (plugin '{provider}') built a {type(obj).__name__} without "
            f"{', '.join(missing)}, which rlhf_plugins.{contract.__name__} requires"
        )
    return obj


def _context(config: Any, spec: PluginSpec, role: str, model_path: str, **extra: Any) -> BackendContext:
    host_memory.apply(config)
    pm = get_manager(spec)
    rank, world = rank_and_world()
    return BackendContext(config, role, model_path, lambda: pm.load_model(role, model_path, config), rank, world,
                          **extra)


class PolicyRole(Role):
    """The actor: a trainable policy behind a learner backend."""

    def __init__(self, config: Any, plugin_spec: PluginSpec, model_path: str, learner: LearnerBackend,
                 provider: str = "", role: str = "actor") -> None:
        self.role = role
        ctx = _context(config, plugin_spec, role, model_path)
        self.backend = self.learner = build_backend(learner, Learner, ctx, provider)
        if role == "actor" and config.learner.ema and not callable(getattr(self.learner, "save_average", None)):
            raise UsageError(f"learner '{learner.name}' (plugin '{provider}') keeps no moving average of the weights, "
                             "which --learner.ema asks for; use the torch, deepspeed or fsdp learner, or drop it")

    @dispatch("split")
    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.learner.logprobs(batch)

    @dispatch("split")
    def train(self, batch: dict[str, torch.Tensor], objective: Any) -> dict[str, float]:
        return self.learner.train(batch, objective)

    @dispatch("all")
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.learner.named_weights()

    @dispatch("all")
    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {name: (tuple(t.shape), str(t.dtype)) for name, t in self.learner.named_weights()}

    def live_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """The learner's parameters themselves, updated in place by every step, under the names the
        engine loads -- or None when the learner has no such tensors (sharded, LoRA-merged)."""
        fn = getattr(self.learner, "live_weights", None)
        return fn() if callable(fn) else None

    @dispatch("all")
    def save(self, path: str) -> None:
        self.learner.save(path)

    @dispatch("all")
    def save_average(self, path: str) -> None:
        """The final model: from the moving average of the weights under --learner.ema, else as ``save``."""
        fn = getattr(self.learner, "save_average", None)
        (fn if callable(fn) else self.learner.save)(path)

    @dispatch("all")
    def save_checkpoint(self, path: str) -> None:
        self.learner.save_checkpoint(path)

    @dispatch("all")
    def load_checkpoint(self, path: str) -> None:
        self.learner.load_checkpoint(path)

    @dispatch("all")
    def shutdown(self) -> None:
        super().shutdown()


class CriticRole(PolicyRole):
    """The PPO critic: per-token values, trained on returns with a clipped value loss."""

    def __init__(self, config: Any, plugin_spec: PluginSpec, model_path: str, learner: LearnerBackend,
                 provider: str = "") -> None:
        super().__init__(config, plugin_spec, model_path, learner, provider, role="critic")

    @dispatch("split")
    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.learner.logprobs(batch)


class ReferenceRole(Role):
    """The frozen initial policy (or --model.reference_path), for KL: a whole model in each rank, or -- given a
    learner backend that ``shards_reference`` -- that learner built frozen for this role, each rank holding a shard."""

    role = "reference"

    def __init__(self, config: Any, plugin_spec: PluginSpec, model_path: str, learner: LearnerBackend | None = None,
                 provider: str = "") -> None:
        from ..models.device import role_device
        from ..models.forward import policy_forward

        self.learner = None
        if learner is not None:
            ctx = _context(config, plugin_spec, "reference", model_path)
            self.backend = self.learner = build_backend(learner, Learner, ctx, provider)
            return
        host_memory.apply(config)
        self.device = role_device()
        self.model = self.backend = get_manager(plugin_spec).load_model("reference", model_path, config)
        self.model.eval().requires_grad_(False).to(self.device)
        self.temperature = config.generation.temperature
        self.budget = config.learner.max_tokens_per_micro_batch
        self._forward = partial(policy_forward, logits_memory_mb=config.learner.logits_memory_mb)

    @dispatch("split")
    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.learner is not None:
            return self.learner.logprobs(batch)
        import torch

        from ..models.device import to_device
        from ..models.packing import in_token_budget

        batch = to_device(batch, self.device)
        with torch.inference_mode():
            return in_token_budget(lambda part: self._forward(self.model, part, self.temperature)["logprobs"], batch,
                                   self.budget, self.model).cpu()


class GenerationRole(Role):
    """The generation engine of the configured backend."""

    role = "generation"

    def __init__(self, config: Any, plugin_spec: PluginSpec, model_path: str, backend: GenerationBackend,
                 provider: str = "", adapter_sync: bool = False) -> None:
        ctx = _context(config, plugin_spec, "generation", model_path, adapter_sync=adapter_sync)
        self.engine = self.backend = build_backend(backend, GenerationEngine, ctx, provider)
        self.name = f"{backend.area} '{backend.name}' (plugin '{provider}')"
        if config.sync.verify:
            self._require("logprobs", "--sync.verify")

    def _require(self, method: str, setting: str) -> Callable[..., Any]:
        fn = getattr(self.engine, method, None)
        if not callable(fn):
            raise UsageError(f"{self.name} has no {method}(), which {setting} needs "
                             f"({OPTIONAL['engine'][method].split(' of ')[0]}); turn {setting} off or use another "
                             "engine")
        return fn

    @dispatch("prompts")
    def generate(self, prompt_ids: list[list[int]], params: Any) -> Any:
        return self.engine.generate(prompt_ids, params)

    def load_weights(self, named_tensors: Any) -> dict[str, Any]:
        return self.engine.load_weights(named_tensors)

    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._require("logprobs", "--sync.verify")(batch)

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return self.engine.weight_shapes()

    def share_weights(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        """Make the engine's parameters these tensors (no copy); False when it cannot."""
        fn = getattr(self.engine, "share_weights", None)
        return bool(fn(named)) if callable(fn) else False

    @dispatch("all")
    def shutdown(self) -> None:
        super().shutdown()
