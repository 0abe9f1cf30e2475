"""The roles of the RL loop as ordinary classes.

A placement plugin decides where each one lives: constructed right here (local
placement) or inside Ray actors; the training loop calls the same methods either
way. Each role rebuilds the plugin manager from a :class:`PluginSpec` in its own
process, so model-loading hooks (PEFT, custom architectures) apply everywhere.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import torch

from ._lazy import resolve
from .errors import RewardError, UsageError
from .manager import PluginSpec, get_manager
from .types import GenerationBackend, LearnerBackend, RewardFunction


def dispatch(mode: str) -> Any:
    """How a role group of several workers (data-parallel ranks) runs a method:

    * ``"split"``: the first argument (a batch) is cut into one shard per rank, at
      prompt-group boundaries; tensor results are concatenated, metric dicts averaged.
    * ``"all"``: every rank runs it with the same arguments (collectives such as
      ZeRO-3 gathers); the result of rank 0 is returned.
    * ``"prompts"``: a list of prompts is spread over the workers (engines) by load;
      the samples come back in prompt order.
    * ``"one"`` (the default): rank 0 alone.

    Local placement ignores it: the role is the object itself.
    """

    def mark(fn: Any) -> Any:
        fn.__rlhf_dispatch__ = mode
        return fn

    return mark


class PolicyRole:
    """The actor: a trainable policy behind a learner backend."""

    def __init__(self, config: Any, plugin_spec: PluginSpec, model_path: str, role: str = "actor") -> None:
        pm = get_manager(plugin_spec)
        backend = pm.components.get(LearnerBackend, config.learner.backend)
        # the learner decides when to load (ZeRO-3 must configure partitioning first)
        self.learner = resolve(backend.factory)(lambda: pm.load_model(role, model_path, config), config, role)

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

    @dispatch("all")
    def adapter_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The LoRA adapter alone (PEFT's saved names) and its config, for adapter sync."""
        from .integrations.peft import adapter_weights, config_dict, peft_info

        info = peft_info(self.learner.model)
        if info is None:
            raise UsageError("adapter sync needs LoRA on the actor: set --lora.rank (or --lora.config)")
        weights = adapter_weights((n, t.cpu()) for n, t in self.learner.raw_named_weights())
        return weights, config_dict(info[0])

    @dispatch("all")
    def save(self, path: str) -> None:
        self.learner.save(path)

    @dispatch("all")
    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    @dispatch("all")
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.learner.load_state_dict(state)

    # --- weight sync over a process group (the learner's rank 0 is the source) -------
    def init_weight_sync(self, address: str, port: int, world_size: int, backend: str) -> None:
        from .sync.groups import SyncGroup

        self.sync_group = SyncGroup(address, port, world_size, 0, backend)

    @dispatch("all")
    def broadcast_weights(self, engines: list[Any], bucket_bytes: int) -> dict[str, Any]:
        """Every rank iterates the weights (ZeRO-3 gathers are collective); rank 0 packs
        them into buckets and, per bucket, makes one call per engine and one broadcast."""
        from .sync.broadcast import send_buckets

        group = getattr(self, "sync_group", None)
        return send_buckets(self.learner.named_weights(), group, engines, bucket_bytes)

    @dispatch("all")
    def ipc_weights(self, engines: list[Any], bucket_bytes: int) -> dict[str, Any]:
        """Every rank iterates the weights (ZeRO-3); rank 0 writes them into shared buffers."""
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() != 0:
            for _ in self.learner.named_weights():
                pass
            return {}
        from .sync.ipc import IPCSender

        if not hasattr(self, "ipc_sender"):
            self.ipc_sender = IPCSender()
        return self.ipc_sender.send(self.learner.named_weights(), engines, bucket_bytes)


class CriticRole(PolicyRole):
    """The PPO critic: per-token values, trained on returns with a clipped value loss."""

    def __init__(self, config: Any, plugin_spec: PluginSpec, model_path: str) -> None:
        super().__init__(config, plugin_spec, model_path, role="critic")

    @dispatch("split")
    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.learner.logprobs(batch)


class ReferenceRole:
    """The frozen initial policy, for KL."""

    def __init__(self, config: Any, plugin_spec: PluginSpec, model_path: str) -> None:
        from .modeling import policy_forward

        self.model = get_manager(plugin_spec).load_model("reference", model_path, config)
        self.model.eval().requires_grad_(False)
        self.temperature = config.generation.temperature
        self._forward = policy_forward

    @dispatch("split")
    @torch.inference_mode()
    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._forward(self.model, batch, self.temperature)["logprobs"]


class GenerationRole:
    """The generation engine of the configured backend."""

    def __init__(self, config: Any, plugin_spec: PluginSpec, model_path: str) -> None:
        backend = get_manager(plugin_spec).components.get(GenerationBackend, config.generation.backend)
        self.engine = resolve(backend.factory)(model_path, config, plugin_spec)

    @dispatch("prompts")
    def generate(self, prompt_ids: list[list[int]], params: Any) -> Any:
        return self.engine.generate(prompt_ids, params)

    def load_weights(self, named_tensors: Any) -> dict[str, Any]:
        return self.engine.load_weights(named_tensors)

    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.engine.logprobs(batch)

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return self.engine.weight_names()

    def sync_ranks(self) -> int:
        """Processes of this engine that receive weights (vLLM: its tensor-parallel workers)."""
        return int(getattr(self.engine, "sync_ranks", lambda: 1)())

    def init_weight_sync(self, address: str, port: int, world_size: int, rank: int, backend: str) -> None:
        self.engine.init_weight_sync(address, port, world_size, rank, backend)

    def receive_bucket(self, bucket: Any) -> dict[str, Any]:
        return self.engine.receive_bucket(bucket)

    def receive_ipc(self, bucket: Any, handle: bytes, index: int) -> dict[str, Any]:
        return self.engine.receive_ipc(bucket, handle, index)

    def load_adapter(self, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, Any]:
        load = getattr(self.engine, "load_adapter", None)
        if not callable(load):
            raise UsageError(f"generation backend '{type(self.engine).__name__}' cannot load LoRA adapters; "
                             "use --lora.sync merged")
        return load(weights, config)

    def commit_weights(self) -> dict[str, Any]:
        """After the last bucket of a sync: engines that load all weights at once do it now."""
        commit = getattr(self.engine, "commit_weights", None)
        return commit() if callable(commit) else {}

    def shutdown(self) -> None:
        self.engine.shutdown()


class RewardRole:
    """Runs the chosen reward functions, checks their output, combines them by weight."""

    def __init__(self, config: Any, plugin_spec: PluginSpec, names: list[str], weights: list[float]) -> None:
        pm = get_manager(plugin_spec)
        self.functions = []
        for name, weight in zip(names, weights):
            comp = pm.components.get(RewardFunction, name)
            provider = pm.components.provider(RewardFunction, name)
            self.functions.append((name, provider, comp.build(config), weight))

    def score(
        self,
        prompts: list[Any],
        completions: list[str],
        completion_ids: list[list[int]],
        columns: dict[str, list[Any]],
        step: int,
    ) -> tuple[list[float], dict[str, list[float | None]]]:
        n = len(completions)
        combined = [0.0] * n
        parts: dict[str, list[float | None]] = {}
        for name, provider, fn, weight in self.functions:
            where = f"reward '{name}' (plugin '{provider}') at step {step}"
            try:
                out = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            except UsageError:
                raise
            except Exception as exc:
                raise RewardError(f"{where} raised {type(exc).__name__}: {exc}".splitlines()[0]) from exc
            values = _as_list(out, where)
            if len(values) != n:
                raise RewardError(f"{where} returned {len(values)} scores for {n} completions")
            for i, v in enumerate(values):
                if v is None:
                    continue
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise RewardError(f"{where} returned {type(v).__name__} {v!r} for sample {i}; expected a number")
                if not math.isfinite(v):
                    raise RewardError(f"{where} returned {v} for sample {i}; scores must be finite numbers")
                combined[i] += weight * float(v)
            parts[name] = [None if v is None else float(v) for v in values]
        return combined, parts


def _as_list(out: Any, where: str) -> list[Any]:
    if torch.is_tensor(out):
        return out.detach().float().reshape(-1).tolist()
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):
        return list(out.tolist())
    if isinstance(out, (list, tuple)):
        return [v.item() if torch.is_tensor(v) else v for v in out]
    raise RewardError(f"{where} returned {type(out).__name__}; expected a list of floats")
