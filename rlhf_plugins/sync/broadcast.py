"""Bucketed broadcast weight sync.

The learner's rank 0 packs weights (same dtype) into flat buckets of about
``sync.bucket_mb``; per bucket it makes *one* call per engine (the bucket's names,
shapes and offsets) and *one* broadcast over the sync group. A per-parameter
scheme (one call and one broadcast per tensor) pays the round trip hundreds of
times per sync; see ``bench/weight_sync.py``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from ..weights import WeightSyncError


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


def send_buckets(named: Iterable[tuple[str, torch.Tensor]], group: Any, engines: list[Any], bucket_bytes: int
                 ) -> dict[str, Any]:
    """Run on every learner rank; only the rank holding ``group`` (rank 0) sends."""
    if group is None:
        for _ in named:  # take part in collective gathers (ZeRO-3)
            pass
        return {}
    futures, tensors, nbytes, count = [], 0, 0, 0
    for bucket, parts in buckets(named, bucket_bytes):
        flat = torch.cat(parts)
        futures += [engine.submit("receive_bucket", bucket) for engine in engines]
        group.broadcast(flat.to(group.device), src=0)
        tensors += len(bucket.names)
        nbytes += flat.numel() * flat.element_size()
        count += 1
    futures += [engine.submit("commit_weights") for engine in engines]
    engines[0].wait(futures)
    return {"tensors": tensors, "bytes": nbytes, "buckets": count, "rpcs": len(futures)}


def bucket_bytes(config: Any) -> int:
    """``sync.bucket_mb`` in bytes; 0 means one tensor per bucket."""
    return int(config.sync.bucket_mb * 2**20)


def receive_bucket(group: Any, bucket: Bucket) -> torch.Tensor:
    flat = torch.empty(bucket.numel, dtype=bucket.torch_dtype, device=group.device)
    group.broadcast(flat, src=0)
    return flat


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
            raise WeightSyncError(f"weight sync: '{name}' is {tuple(shape)} in the learner but {tuple(eshape)} in the engine")
        if _is_float(dtype) != _is_float(edtype):
            raise WeightSyncError(f"weight sync: '{name}' is {dtype} in the learner but {edtype} in the engine")


def _is_float(dtype: str) -> bool:
    return any(k in dtype for k in ("float", "bfloat"))


class BroadcastSync:
    """``--sync.method broadcast``: learner rank 0 -> every engine worker."""

    same_process = False

    def __init__(self, config: Any) -> None:
        self.bucket_bytes = bucket_bytes(config)
        self.engines: list[Any] | None = None

    def setup(self, actor: Any, engine: Any) -> None:
        check_names(actor.weight_shapes(), engine.weight_shapes())
        self.engines = engine.endpoints()
        source = actor.endpoints()[0]
        address, port = source.call("free_address")
        backend = source.call("sync_backend")
        ranks = [e.call("sync_ranks") for e in self.engines]
        world = 1 + sum(ranks)
        futures = [source.submit("init_weight_sync", address, port, world, backend)]
        offset = 1
        for endpoint, n in zip(self.engines, ranks):
            futures.append(endpoint.submit("init_weight_sync", address, port, world, offset, backend))
            offset += n
        source.wait(futures)

    def sync(self, actor: Any, engine: Any, step: int) -> dict[str, Any]:
        start = time.perf_counter()
        if self.engines is None:
            self.setup(actor, engine)
        info = actor.broadcast_weights(self.engines, self.bucket_bytes)
        info.update(method="broadcast", seconds=time.perf_counter() - start)
        return info
