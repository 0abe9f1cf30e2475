"""What backends exchange with the loop: sampling parameters and samples, a batch, the training
objective, and the contexts each factory and each per-rank call receives. Every field is part of
the contract a third-party engine, learner, placement or sync method is written against.

Nothing here imports torch.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from .config import Config

#: ``name -> (shape, dtype string)`` of the tensors a model holds, as ``weight_shapes()`` returns it
WeightShapes = dict[str, tuple[tuple[int, ...], str]]
#: a batch: ``sequences`` ``[B, P + T]`` (left-padded prompt, right-padded completion),
#: ``attention_mask`` ``[B, P + T]``, ``action_mask`` ``[B, T]`` (1 on completion tokens), and
#: per-step extras (``advantages``, ``old_logprobs``, ``ref_logprobs``, ``returns``, ``values`` ...);
#: ``group_size`` and ``prompt_width`` are layout hints (samples of one prompt are consecutive)
Batch = dict[str, Any]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``n`` completions per prompt of at most ``max_new_tokens`` tokens.
    ``seed`` makes a call reproducible (the loop derives one per step); the call's samples must still
    be independent draws: an engine that seeds each prompt's request on its own gives each prompt
    ``derived_seed(seed, index)``, never ``seed`` itself."""

    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    #: tokens below this fraction of the most likely token's probability are not drawn (0: off)
    min_p: float = 0.0
    #: a token already in the prompt or the completion has its logit divided by this when positive,
    #: multiplied when negative, before the temperature (HF's and vLLM's rule; 1: off)
    repetition_penalty: float = 1.0
    #: a completion ends once its text contains one of these strings: the token that completes it is
    #: kept (as vLLM keeps it) and the finish reason is "stop"
    stop: tuple[str, ...] = ()


def derived_seed(seed: int, *keys: int | str) -> int:
    """The seed of one part of a seeded call (a prompt's request, an engine's share of the prompts):
    a hash of ``seed`` and ``keys``, so that the parts of one call, and calls whose seeds differ by a
    little (the loop's next step, round or turn), draw unrelated streams. Below 2**62: vLLM seeds a
    request's ``k``-th sample with its seed + ``k``."""
    digest = hashlib.blake2b(repr((seed, *keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclass
class Samples:
    """What ``generate`` returns: ``n`` consecutive samples per prompt, in prompt order."""

    #: index of each sample's prompt in the ``prompt_ids`` given to ``generate``
    prompt_index: list[int] = field(default_factory=list)
    #: the sampled tokens, exactly as sampled (EOS included when the model stopped)
    completion_ids: list[list[int]] = field(default_factory=list)
    #: log-prob of each sampled token under the sampling distribution, log softmax(logits / temperature)
    logprobs: list[list[float]] = field(default_factory=list)
    #: "stop" (EOS) or "length" (the token budget ran out)
    finish_reasons: list[str] = field(default_factory=list)
    #: prompt tokens the engine served from its prefix cache (None: the engine does not say)
    cached_prompt_tokens: int | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)


@dataclass
class BackendContext:
    """What every engine and learner factory receives (``factory(ctx)``), in the process that
    owns the role: this process under local placement, the role's Ray actor under Ray."""

    config: Config
    #: "actor", "critic", "reference", "generation" or "reward"
    role: str
    #: the local ``save_pretrained`` folder of the role's model
    model_path: str
    #: loads the role's model through the ``rlhf_load_model`` hook (so PEFT and custom
    #: architectures apply); call it when ready (ZeRO-3 sets up partitioning first)
    load_model: Callable[[], Any]
    #: this rank and the role's number of ranks (data parallel for learners, engines for generation)
    rank: int = 0
    world_size: int = 1
    #: engines: LoRA adapters will arrive through ``load_adapter`` (start with adapter support)
    adapter_sync: bool = False


@dataclass
class PlacementContext:
    """What a placement factory receives (``factory(ctx)``)."""

    config: Config
    #: the roles this run places, in start order
    roles: tuple[str, ...]
    #: ranks a component asked for, by role (the generation backend's ``workers``); roles not
    #: listed take the placement's own setting (e.g. ``--ray.actor_workers``)
    workers: dict[str, int] = field(default_factory=dict)
    #: roles that hold a model and want an accelerator (the reward role only with reward models)
    accelerated: tuple[str, ...] = ("generation", "actor", "reference", "critic")
    #: rebuilds the plugin manager in another process (roles do it themselves; a placement that
    #: ships code by value, as Ray does, reads ``plugin_spec.file_modules()``)
    plugin_spec: Any = None


@dataclass
class RankContext:
    """What a function given to :meth:`RoleHandle.run` (or an endpoint) receives, in the process
    of one rank: the backend object and a scratch dict that lives as long as the role."""

    #: the learner (actor, critic), the engine (generation) or the model (reference) of this rank
    backend: Any
    role: str
    rank: int
    world_size: int
    #: per-process state that survives between calls (a sync method keeps its process group here)
    state: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Objective(Protocol):
    """What a learner's ``train(batch, objective)`` minimises: the policy objective (policy loss +
    KL term - entropy bonus, aggregated as configured) for the actor, the clipped value loss for
    the critic. Picklable: Ray learner workers receive it as is.

    * ``objective(outputs, micro_batch) -> (loss, metrics)`` -- ``outputs`` is the learner's
      forward of the micro batch: ``{"logprobs": [b, T]}`` (plus ``"entropy"`` when
      ``needs_entropy``), or ``{"values": [b, T]}`` for a critic; ``loss`` is a scalar tensor to
      scale by ``weight`` and backpropagate, ``metrics`` tensors or floats to average.
    * ``weight(micro_mask, mini_mask)`` -- the micro batch's share of its mini batch's loss (token
      or sequence counts, by the aggregation); under several ranks multiply by the shard's
      ``dp_weight``.
    * ``needs_entropy`` -- whether ``outputs`` must hold the per-token entropy.
    """

    @property
    def needs_entropy(self) -> bool: ...

    def weight(self, micro_mask: torch.Tensor, mini_mask: torch.Tensor) -> float: ...

    def __call__(self, outputs: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]: ...
