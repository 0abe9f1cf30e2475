"""Colocated weight sync by IPC handle: CUDA IPC on GPU, shared memory on CPU.

The learner's rank 0 keeps one shared buffer per bucket for the whole run. A sync
copies the weights into the buffers and sends each engine one call per bucket
with the buffer's handle (the handle is opened once per engine). An engine whose
model can alias the buffer (same dtype, the transformers engine) points its
parameters at it -- zero copies on the receiving side; vLLM copies (its CPU
kernels repack weights).
"""
from __future__ import annotations

import pickle
import time
from typing import Any, Iterable

import torch

from .broadcast import Bucket, bucket_bytes, buckets, check_names


def ipc_handle(tensor: torch.Tensor) -> bytes:
    """Bytes another process on this host turns back into the same memory."""
    if tensor.is_cuda:  # pragma: no cover - GPU branch
        from torch.multiprocessing.reductions import reduce_tensor

        return pickle.dumps(("cuda", reduce_tensor(tensor)))
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's shared-memory reductions

    return pickle.dumps(("cpu", bytes(ForkingPickler.dumps(tensor))))


def open_handle(handle: bytes) -> torch.Tensor:
    kind, payload = pickle.loads(handle)
    if kind == "cuda":  # pragma: no cover - GPU branch
        rebuild, args = payload
        args = list(args)
        args[6] = torch.cuda.current_device()  # the sender's device index means nothing here
        return rebuild(*args)
    return pickle.loads(payload)


class IPCSender:
    """Lives in the learner's rank 0: the shared buffers and their handles."""

    def __init__(self) -> None:
        torch.multiprocessing.set_sharing_strategy("file_system")  # CPU handles by name, openable by any process
        self.buffers: list[tuple[Bucket, torch.Tensor, bytes]] = []

    def _buffer(self, index: int, bucket: Bucket, device: torch.device) -> tuple[torch.Tensor, bytes]:
        if index < len(self.buffers):
            old, buf, handle = self.buffers[index]
            if old.names == bucket.names and old.shapes == bucket.shapes and old.dtype == bucket.dtype:
                return buf, handle
        buf = torch.empty(bucket.numel, dtype=bucket.torch_dtype, device=device)
        if buf.device.type == "cpu":
            buf.share_memory_()
        handle = ipc_handle(buf)
        entry = (bucket, buf, handle)
        if index < len(self.buffers):
            self.buffers[index] = entry
        else:
            self.buffers.append(entry)
        return buf, handle

    def send(self, named: Iterable[tuple[str, torch.Tensor]], engines: list[Any], size: int) -> dict[str, Any]:
        futures, tensors, nbytes = [], 0, 0
        for index, (bucket, parts) in enumerate(buckets(named, size)):
            buf, handle = self._buffer(index, bucket, parts[0].device)
            offset = 0
            for part in parts:
                buf[offset : offset + part.numel()].copy_(part)
                offset += part.numel()
            futures += [engine.submit("receive_ipc", bucket, handle, index) for engine in engines]
            tensors += len(bucket.names)
            nbytes += buf.numel() * buf.element_size()
        futures += [engine.submit("commit_weights") for engine in engines]
        engines[0].wait(futures)  # buffers are rewritten only after every engine has read them
        return {"tensors": tensors, "bytes": nbytes, "buckets": len(self.buffers), "rpcs": len(futures)}


class IPCReceiver:
    """Lives in an engine: opened buffers by bucket index, and whether the model aliases them."""

    def __init__(self) -> None:
        self.opened: dict[int, tuple[bytes, torch.Tensor, bool]] = {}

    def receive(self, model: torch.nn.Module, bucket: Bucket, handle: bytes, index: int) -> dict[str, Any]:
        from ..weights import load_named_weights

        entry = self.opened.get(index)
        if entry is None or entry[0] != handle:
            flat = open_handle(handle)
            aliased = alias(model, bucket.unpack(flat))
            self.opened[index] = entry = (handle, flat, aliased)
        if entry[2]:
            return {"tensors": len(bucket.names), "copied": 0}
        load_named_weights(model, bucket.unpack(entry[1]))
        return {"tensors": len(bucket.names), "copied": len(bucket.names)}


def alias(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> bool:
    """Point parameters at the shared views when every one matches in shape and dtype."""
    params = dict(model.named_parameters())
    pairs = list(named)
    if not all(n in params and params[n].shape == v.shape and params[n].dtype == v.dtype
               and params[n].device == v.device for n, v in pairs):
        return False
    with torch.no_grad():
        for name, view in pairs:
            params[name].data = view
    return True


class IPCSync:
    """``--sync.method ipc``: learner and engine colocated on one node (``--ray.colocate all``)."""

    same_process = False

    def __init__(self, config: Any) -> None:
        self.bucket_bytes = bucket_bytes(config)
        self.engines: list[Any] | None = None

    def sync(self, actor: Any, engine: Any, step: int) -> dict[str, Any]:
        start = time.perf_counter()
        if self.engines is None:
            check_names(actor.weight_shapes(), engine.weight_shapes())
            self.engines = engine.endpoints()
        info = actor.ipc_weights(self.engines, self.bucket_bytes)
        info.update(method="ipc", seconds=time.perf_counter() - start)
        return info
