"""``--sync.method broadcast``: bucketed broadcast from the learner's rank 0 to every engine worker.

This module owns both ends. Rank 0 of the actor packs weights (same dtype) into flat buckets of
about ``sync.bucket_mb``; per bucket it makes *one* call per engine (the bucket's names, shapes
and offsets) and *one* broadcast over a process group spanning itself and every worker of every
engine (NCCL on GPU, gloo on CPU). A worker that loads part by part (``load_weights_part``: vLLM's
layerwise reload, the transformers engine) loads each bucket as it arrives, holding about two buckets
and one layer; others keep every bucket and load them in one ``load_weights`` at the end. A
per-parameter scheme (one call and one broadcast per tensor, ``--sync.bucket_mb 0``)
pays the round trip hundreds of times per sync; see ``bench/weight_sync.py``.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.weights import WeightSyncError
from ..protocols import ModelWorker, RankContext, on_model_workers

KEY = "broadcast_sync"


@dataclass
class Bucket:
    dtype: str
    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    numel: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.removeprefix("torch."))

    def unpack(self, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        offset = 0
        for name, shape in zip(self.names, self.shapes):
            n = 1
            for d in shape:
                n *= d
            yield name, flat[offset : offset + n].view(shape)
            offset += n


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
            ) -> Iterator[tuple[Bucket, list[torch.Tensor]]]:
    """Group consecutive same-dtype tensors into buckets of about ``bucket_bytes``
    (``bucket_bytes <= 0``: one tensor per bucket, the per-parameter scheme)."""
    current: Bucket | None = None
    parts: list[torch.Tensor] = []
    size = 0
    for name, tensor in named:
        dtype = str(tensor.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if current is not None and (current.dtype != dtype or size + nbytes > bucket_bytes):
            yield current, parts
            current, parts, size = None, [], 0
        if current is None:
            current = Bucket(dtype)
        current.names.append(name)
        current.shapes.append(tuple(tensor.shape))
        current.numel += tensor.numel()
        parts.append(tensor.reshape(-1))
        size += nbytes
    if current is not None:
        yield current, parts


def bucket_bytes(config: Any) -> int:
    """``sync.bucket_mb`` in bytes; 0 means one tensor per bucket."""
    return int(config.sync.bucket_mb * 2**20)


def check_names(learner: dict[str, Any], engine: dict[str, Any]) -> None:
    """Every learner tensor must exist in the engine with the same shape; float dtypes may differ."""
    missing = [n for n in learner if n not in engine]
    if missing:
        sample = next(iter(engine), "?")
        raise WeightSyncError(
            f"weight sync: the engine has no tensor named '{missing[0]}' ({len(missing)} of {len(learner)} "
            f"learner names are unknown; engine names look like '{sample}')"
        )
    for name, (shape, dtype) in learner.items():
        eshape, edtype = engine[name]
        if tuple(shape) != tuple(eshape):
            raise WeightSyncError(f"weight sync: '{name}' is {tuple(shape)} in the learner but {tuple(eshape)} in the "
                                  "engine")
        if _is_float(dtype) != _is_float(edtype):
            raise WeightSyncError(f"weight sync: '{name}' is {dtype} in the learner but {edtype} in the engine")


def _is_float(dtype: str) -> bool:
    return any(k in dtype for k in ("float", "bfloat"))


def pending(worker: ModelWorker) -> list[tuple[str, torch.Tensor]]:
    """What a model worker received since its last commit."""
    return worker.state.setdefault("pending_weights", [])


def receive(worker: ModelWorker, named: list[tuple[str, torch.Tensor]]) -> None:
    """Hand a worker part of a sync: loaded now where it loads part by part, else kept for the commit."""
    part = getattr(worker, "load_weights_part", None)
    if callable(part):
        part(named)
        worker.state["streamed"] = True
    else:
        pending(worker).extend(named)


def commit_worker(worker: ModelWorker) -> int:
    """Load everything received since the last commit at once (finish a sync loaded part by part)."""
    received = pending(worker)
    if received:
        worker.load_weights(list(received))
    count = len(received)
    received.clear()
    if worker.state.pop("streamed", False):
        worker.finish_weights()
    return count


def commit(ctx: RankContext) -> int:
    """Engine side, after the last bucket of a sync."""
    return sum(on_model_workers(ctx.backend, commit_worker))


# --- process-group set-up -------------------------------------------------------------------


def _free_address(ctx: RankContext) -> tuple[str, int, str]:
    from .groups import default_backend, free_address

    return (*free_address(), default_backend())


def _worker_rank(worker: ModelWorker) -> int:
    return int(worker.rank)


def _model_workers(ctx: RankContext) -> int:
    return len(on_model_workers(ctx.backend, _worker_rank))


def _learner_join(ctx: RankContext, address: str, port: int, world: int, backend: str) -> None:
    from .groups import SyncGroup

    ctx.state[KEY] = SyncGroup(address, port, world, 0, backend)


def _worker_join(worker: ModelWorker, address: str, port: int, world: int, offset: int, backend: str) -> int:
    from .groups import SyncGroup

    rank = offset + int(worker.rank)
    worker.state[KEY] = SyncGroup(address, port, world, rank, backend)
    return rank


def _engine_join(ctx: RankContext, address: str, port: int, world: int, offset: int, backend: str) -> list[int]:
    return on_model_workers(ctx.backend, _worker_join, address, port, world, offset, backend)


# --- one sync --------------------------------------------------------------------------------


def _worker_receive(worker: ModelWorker, bucket: Bucket) -> int:
    group = worker.state[KEY]
    flat = torch.empty(bucket.numel, dtype=bucket.torch_dtype, device=group.device)
    group.broadcast(flat, src=0)
    receive(worker, list(bucket.unpack(flat)))
    return len(bucket.names)


def _receive(ctx: RankContext, bucket: Bucket) -> int:
    return sum(on_model_workers(ctx.backend, _worker_receive, bucket))


def _send(ctx: RankContext, engines: list[Any], size: int) -> dict[str, Any]:
    """Every learner rank iterates the weights (ZeRO-3 gathers are collective); rank 0 sends."""
    named = ctx.backend.named_weights()
    group = ctx.state.get(KEY)
    if group is None:
        for _ in named:
            pass
        return {}
    futures, tensors, nbytes, count = [], 0, 0, 0
    for bucket, parts in buckets(named, size):
        flat = torch.cat(parts)
        futures += [endpoint.submit(_receive, bucket) for endpoint in engines]
        group.broadcast(flat.to(group.device), src=0)
        tensors += len(bucket.names)
        nbytes += flat.numel() * flat.element_size()
        count += 1
    futures += [endpoint.submit(commit) for endpoint in engines]
    engines[0].wait(futures)
    return {"tensors": tensors, "bytes": nbytes, "buckets": count, "rpcs": len(futures)}


class BroadcastSync:
    def __init__(self, config: Any) -> None:
        self.bucket_bytes = bucket_bytes(config)
        self.engines: list[Any] | None = None

    def setup(self, actor: Any, engine: Any) -> None:
        check_names(actor.weight_shapes(), engine.weight_shapes())
        self.engines = engine.endpoints()
        address, port, backend = actor.run(_free_address, rank=0)
        workers = [e.call(_model_workers) for e in self.engines]
        world = 1 + sum(workers)
        futures = [actor.endpoints()[0].submit(_learner_join, address, port, world, backend)]
        offset = 1
        for endpoint, n in zip(self.engines, workers):
            futures.append(endpoint.submit(_engine_join, address, port, world, offset, backend))
            offset += n
        actor.endpoints()[0].wait(futures)

    def sync(self, actor: Any, engine: Any, step: int) -> dict[str, Any]:
        if self.engines is None:
            self.setup(actor, engine)
        return actor.run(_send, self.engines, self.bucket_bytes)[0]
