"""Backend contracts: what a generation engine, a learner, a placement and a weight-sync method
must provide, what they may provide, and when the loop calls each method.

A third-party backend is written against these protocols and the data types they exchange
(:mod:`rlhf_plugins.backend_data`), all exported from :mod:`rlhf_plugins`; it never needs a
private module. Each area has one factory signature:

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
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .backend_data import (
    BackendContext,
    Batch,
    Objective,
    PlacementContext,
    RankContext,
    Samples,
    SamplingParams,
    WeightShapes,
)

if TYPE_CHECKING:
    import torch

__all__ = ["OPTIONAL", "BackendContext", "Batch", "Endpoint", "GenerationEngine", "Learner", "ModelWorker",
           "Objective", "Placement", "PlacementContext", "RankContext", "RoleHandle", "Samples", "SamplingParams",
           "WeightShapes", "WeightSync", "missing_methods", "on_model_workers", "share_weights"]

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
    the model at shared tensors without a copy (IPC sync), returning whether it did;
    ``load_weights_part(named)`` / ``finish_weights()`` to load a bucketed sync as it arrives (a layer
    may span two calls; ``finish_weights`` after the last), so a sync stages buckets, not the model.
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

    # optional (``OPTIONAL["model_worker"]``): ``share_weights(named) -> bool``, see :func:`share_weights`;
    # ``load_weights_part(named)`` and ``finish_weights()``, as on :class:`GenerationEngine`

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
      is an :class:`Objective`. Returns averaged metrics (floats). Under several ranks each
      rank gets a shard with ``dp_weight`` (its share of the global loss).
    * ``named_weights()`` -- at every weight sync (and save): iterate ``(name, full tensor)`` in the
      engine's naming (LoRA merged in); every rank iterates (gathers may be collective).
    * ``save(path)`` -- ``save_pretrained``-style export of the policy (rank 0 writes).
    * ``save_checkpoint(path)`` / ``load_checkpoint(path)`` -- at every checkpoint and on resume,
      on every rank with the same folder: write (read) everything needed to continue training
      exactly -- weights, optimizer, counters, random state; each rank its own shards.
    * ``shutdown()`` -- once, at the end.

    Optional (``OPTIONAL["learner"]``): ``adapter_state()`` returning ``(adapter tensors under
    PEFT's saved names, LoRA config dict)`` for adapter sync; ``live_weights()``, the parameters the
    optimizer updates in place, in the engine's naming (or None when they are not what an engine
    would read), for an in-process engine to share them; ``save_average(path)``, the final model
    saved from a moving average of the weights (``--learner.ema``). Declare ``multi_rank=True`` on the
    ``LearnerBackend`` when the learner can run several data-parallel ranks.
    """

    def logprobs(self, batch: Batch) -> torch.Tensor: ...

    def train(self, batch: Batch, objective: Objective) -> dict[str, float]: ...

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

    Optional (``OPTIONAL["role_handle"]``), for a placement that can host several roles in one
    process (``--ray.colocate hybrid``): ``hosted_with(other)`` -- whether ``other``'s single rank
    lives in this handle's single process; ``run_with(other, fn)`` -- ``fn(this role's object,
    other's)`` in that process (the in-process sync copies or shares weights this way).
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

    Optional (``OPTIONAL["placement"]``): ``ready()`` -- called once every role is created, for a
    placement whose ``create_role`` returns before the role is up (roles starting concurrently): wait
    for them, raise the first failure. ``recover()`` with an attribute ``max_restarts`` (int): when
    ``max_restarts > 0`` and a role call raises :class:`rlhf_plugins.errors.RoleFailed`, the loop
    calls ``recover()``, which restarts the roles that died (keeping their handles) and returns
    their names, or raises ``RoleFailed`` once its budget is spent; the loop then loads the latest
    checkpoint everywhere and goes on.
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
    an engine's model through :func:`on_model_workers`.

    Optional (``OPTIONAL["sync"]``): ``attach(actor, engine)`` -- once, when the roles are up and
    again after a restart, before the first ``sync``; its dict reaches ``rlhf_after_weight_sync``
    as ``info["setup"]`` with the next sync (the in-process method shares the learner's parameters
    with the engine here when the run allows, so its syncs move nothing)."""

    def sync(self, actor: Any, engine: Any, step: int) -> dict[str, Any]: ...


#: optional methods by contract, and the capability or setting that uses each
OPTIONAL: dict[str, dict[str, str]] = {
    "engine": {
        "logprobs": "the engine/learner parity probe of --sync.verify",
        "load_adapter": "adapter sync (GenerationBackend(supports_adapter=True))",
        "model_workers": "weights held in other processes (tensor-parallel workers)",
        "share_weights": "zero-copy IPC sync",
        "load_weights_part": "a bucketed sync loaded as it arrives (bounded staging; with finish_weights)",
        "finish_weights": "the end of a sync loaded part by part (load_weights_part)",
    },
    "learner": {
        "adapter_state": "adapter sync (LoRA on the actor)",
        "live_weights": "an engine in the learner's process reading its parameters (LearnerBackend(live_weights=True))",
        "save_average": "--learner.ema: the final model saved from that average (else ``save``)",
    },
    "placement": {
        "ready": "roles created concurrently: wait until they are up",
        "recover": "restarting roles after a failure (with a max_restarts attribute > 0)",
    },
    "role_handle": {
        "hosted_with": "several roles in one process (--ray.colocate hybrid)",
        "run_with": "a call that needs two roles' objects in their shared process (in-process sync)",
    },
    "model_worker": {
        "share_weights": "zero-copy IPC sync: alias shared tensors instead of copying them",
        "load_weights_part": "a bucketed sync loaded as it arrives (bounded staging; with finish_weights)",
        "finish_weights": "the end of a sync loaded part by part (load_weights_part)",
    },
    "sync": {
        "attach": "work done once when the roles are up and after a restart (inprocess: share parameters)",
    },
}


class _EngineWorker:
    """An engine whose weights live in its own process, seen as its single model worker."""

    def __init__(self, engine: Any, state: dict[str, Any]) -> None:
        self.engine, self.rank, self.state = engine, 0, state

    def load_weights(self, named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        return self.engine.load_weights(named)

    def __getattr__(self, name: str) -> Any:  # the engine's optional worker methods, where it has them
        if name in OPTIONAL["model_worker"]:
            return getattr(self.engine, name)
        raise AttributeError(name)


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
