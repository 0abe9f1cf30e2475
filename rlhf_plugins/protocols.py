"""Backend contracts: what a generation engine, a learner, a placement and a weight-sync method
must provide, what they may provide, and when the loop calls each method.

A third-party backend is written against these protocols and the data types beside them,
all exported from :mod:`rlhf_plugins`; it never needs a private module. Each area has one
factory signature:

* engines and learners: ``factory(ctx: BackendContext)``;
* placements: ``factory(ctx: PlacementContext)``;
* weight-sync methods: ``factory(config)``.

Optional methods are listed in ``OPTIONAL`` and called only when the capability that needs them
is asked for (``validate`` checks what it can before anything starts; the role that calls an
optional method names the missing method and the setting that needs it otherwise).

Nothing here imports torch.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
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


# --- data ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``n`` completions per prompt of at most ``max_new_tokens`` tokens.
    ``seed`` makes a call reproducible (the loop derives one per step)."""

    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


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


# --- generation engines --------------------------------------------------------------------


@runtime_checkable
class GenerationEngine(Protocol):
    """A generation backend's engine (``GenerationBackend(factory=...)``, ``factory(ctx)``).

    Required methods, in the order the loop first calls them:

    * ``weight_shapes()`` -- once, before the first weight sync: the names, shapes and dtypes the
      engine accepts in ``load_weights`` (names as the learner's ``named_weights`` gives them).
    * ``generate(prompt_ids, params)`` -- every step (and every refill round of dynamic filtering):
      ``params.n`` samples for each prompt of token ids; returns :class:`Samples`.
    * ``load_weights(named)`` -- after every optimizer step, with in-process sync (and by
      sync methods that move tensors here): copy ``(name, tensor)`` pairs into the model in place;
      return ``{"tensors": count, ...}``.
    * ``shutdown()`` -- once, at the end (also after an error): free what the engine holds.

    Optional (see ``OPTIONAL["engine"]``): ``logprobs(batch)`` for ``--sync.verify``;
    ``load_adapter(weights, config)`` for adapter sync (declare ``supports_adapter=True`` on the
    ``GenerationBackend``); ``model_workers(fn, *args)`` when the weights live in other processes
    (tensor-parallel workers): run ``fn(worker, *args)`` in each, ``worker`` being a
    :class:`ModelWorker`, and return the results in worker order; ``share_weights(named)`` to point
    the model at shared tensors without a copy (IPC sync), returning whether it did.
    """

    def weight_shapes(self) -> WeightShapes: ...

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Samples: ...

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class ModelWorker(Protocol):
    """One process holding (a shard of) an engine's weights, as a sync method sees it through
    :func:`on_model_workers`."""

    #: rank of this worker within its engine (0 .. workers - 1)
    rank: int
    #: per-process state that survives between calls
    state: dict[str, Any]

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]: ...


# --- learners ----------------------------------------------------------------------------


@runtime_checkable
class Learner(Protocol):
    """A learner backend (``LearnerBackend(factory=...)``, ``factory(ctx)``): a trainable model
    and its optimizer, one object per data-parallel rank.

    Required methods:

    * ``logprobs(batch)`` -- every step when the loop needs the rollout-time policy (several
      updates per rollout, KL in the reward) and, for a critic, its values: ``[B, T]`` log-probs of
      the completion tokens at the sampling temperature (values for the ``critic`` role), no grad.
    * ``train(batch, objective)`` -- every step: one pass of updates over the batch; ``objective``
      is callable as ``objective(outputs, micro_batch) -> (loss, metrics)`` and gives
      ``objective.weight(micro_mask, mini_mask)`` (the micro batch's share of its mini batch) and
      ``objective.needs_entropy``. Returns averaged metrics (floats). Under several ranks each
      rank gets a shard with ``dp_weight`` (its share of the global loss).
    * ``named_weights()`` -- at every weight sync (and save): iterate ``(name, full tensor)`` in the
      engine's naming (LoRA merged in); every rank iterates (gathers may be collective).
    * ``save(path)`` -- ``save_pretrained``-style export of the policy (rank 0 writes).
    * ``save_checkpoint(path)`` / ``load_checkpoint(path)`` -- at every checkpoint and on resume,
      on every rank with the same folder: write (read) everything needed to continue training
      exactly -- weights, optimizer, counters, random state; each rank its own shards.
    * ``shutdown()`` -- once, at the end.

    Optional (``OPTIONAL["learner"]``): ``adapter_state()`` returning ``(adapter tensors under
    PEFT's saved names, LoRA config dict)`` for adapter sync. Declare ``multi_rank=True`` on the
    ``LearnerBackend`` when the learner can run several data-parallel ranks.
    """

    def logprobs(self, batch: Batch) -> torch.Tensor: ...

    def train(self, batch: Batch, objective: Any) -> dict[str, float]: ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def save(self, path: str) -> None: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def shutdown(self) -> None: ...


# --- placement ------------------------------------------------------------------------------


@runtime_checkable
class Endpoint(Protocol):
    """One rank of a role, addressable from any process (a sync method hands these to the other side).

    ``submit(fn, *args)`` starts ``fn(RankContext, *args)`` on that rank and returns a handle;
    ``wait(handles)`` returns their results in order; ``call`` is submit + wait."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    def call(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    def wait(self, handles: list[Any]) -> list[Any]: ...


@runtime_checkable
class RoleHandle(Protocol):
    """What a placement returns for a role: the role object's methods (the loop calls them the same
    way whatever the placement), plus two generic calls for sync methods and plugins:

    * ``run(fn, *args, rank=None)`` -- ``fn(RankContext, *args)`` on every rank (a list of results,
      rank order) or on ``rank`` alone (its result);
    * ``endpoints()`` -- one :class:`Endpoint` per rank.
    """

    def run(self, fn: Callable[..., Any], *args: Any, rank: int | None = None) -> Any: ...

    def endpoints(self) -> list[Endpoint]: ...


@runtime_checkable
class Placement(Protocol):
    """A placement strategy (``PlacementStrategy(factory=...)``, ``factory(ctx: PlacementContext)``).

    * ``create_role(role, cls, *args, **kwargs)`` -- once per role at set-up, in the order of
      ``ctx.roles``: construct ``cls(*args, **kwargs)`` once per rank where the role lives (set
      ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` before constructing
      a rank of several) and return a :class:`RoleHandle`. Methods of ``cls`` marked with
      ``rlhf_plugins.dispatch`` say how to call several ranks.
    * ``describe()`` -- ``{where: what}`` lines printed at start-up.
    * ``shutdown()`` -- once, at the end (also after an error): stop every role, release resources.

    Optional: ``ready()`` -- called once every role is created, for a placement whose ``create_role``
    returns before the role is up (roles starting concurrently): wait for them, raise the first failure.
    """

    def create_role(self, role: str, cls: type, *args: Any, **kwargs: Any) -> Any: ...

    def describe(self) -> dict[str, str]: ...

    def shutdown(self) -> None: ...


# --- weight sync ------------------------------------------------------------------------------


@runtime_checkable
class WeightSync(Protocol):
    """A weight-sync method (``WeightSyncMethod(factory=...)``, ``factory(config)``), one object in
    the driver. ``sync(actor, engine, step)`` runs after every optimizer step (and after a resume):
    move the actor's new weights into every engine and return what moved (``tensors``, ``bytes``,
    ``rpcs``...; the loop adds ``method`` and ``seconds``). ``actor`` and ``engine`` are
    :class:`RoleHandle`\\ s: code that must run beside the learner or the engine goes through
    ``run`` / ``endpoints`` as module-level functions taking a :class:`RankContext`, and code beside
    an engine's model through :func:`on_model_workers`."""

    def sync(self, actor: Any, engine: Any, step: int) -> dict[str, Any]: ...


#: optional methods by contract, and the capability or setting that uses each
OPTIONAL: dict[str, dict[str, str]] = {
    "engine": {
        "logprobs": "the engine/learner parity probe of --sync.verify",
        "load_adapter": "adapter sync (GenerationBackend(supports_adapter=True))",
        "model_workers": "weights held in other processes (tensor-parallel workers)",
        "share_weights": "zero-copy IPC sync",
    },
    "learner": {
        "adapter_state": "adapter sync (LoRA on the actor)",
    },
}


class _EngineWorker:
    """An engine whose weights live in its own process, seen as its single model worker."""

    def __init__(self, engine: Any, state: dict[str, Any]) -> None:
        self.engine, self.rank, self.state = engine, 0, state

    def load_weights(self, named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        return self.engine.load_weights(named)

    def share_weights(self, named: Iterable[tuple[str, Any]]) -> bool:
        share = getattr(self.engine, "share_weights", None)
        return bool(share(named)) if callable(share) else False


_WORKER_STATE: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def on_model_workers(engine: Any, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``fn(worker: ModelWorker, *args)`` in every process that holds the engine's weights:
    through the engine's ``model_workers`` when it has one, else once, here, with the engine
    itself as the worker. Results in worker order."""
    run = getattr(engine, "model_workers", None)
    if callable(run):
        return list(run(fn, *args))
    state = _WORKER_STATE.setdefault(engine, {})
    return [fn(_EngineWorker(engine, state), *args)]


def share_weights(worker: Any, named: Iterable[tuple[str, Any]]) -> bool:
    """Let a model worker alias shared tensors if it can (``share_weights``); False otherwise."""
    share = getattr(worker, "share_weights", None)
    return bool(share(named)) if callable(share) else False


def missing_methods(obj: Any, contract: type) -> list[str]:
    """Required methods of ``contract`` that ``obj`` lacks (for one-line errors)."""
    names = [n for n in vars(contract) if not n.startswith("_") and callable(getattr(contract, n))]
    return [n for n in names if not callable(getattr(obj, n, None))]
