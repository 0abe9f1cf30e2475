"""``--sync.method ipc``: colocated weight sync by IPC handle (CUDA IPC on GPU, shared memory on CPU).

This module owns both ends. The learner's rank 0 keeps one shared buffer per bucket for the whole
run; a sync copies the weights into the buffers and sends each engine one call per bucket with the
buffer's handle (opened once per model worker). A worker that can alias the buffer (same dtype,
``share_weights``: the transformers engine) points its parameters at it -- zero copies on the
receiving side, later syncs move nothing; others (vLLM repacks weights for its CPU kernels) load
from the buffer at the commit. Needs the engine on the learner's node and device.

CPU buffers are files of our own in shared memory (``/dev/shm/rlhf-ipc-<pid>-...``), unlinked as soon as
every engine has mapped them (the mappings live on), so a run that ends -- however it ends -- leaves
none behind; a sender also removes the files of senders that died before unlinking theirs.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..protocols import ModelWorker, RankContext, on_model_workers, share_weights
from .broadcast import Bucket, bucket_bytes, buckets, check_names, commit, pending

KEY = "ipc_sync"


def ipc_handle(tensor: torch.Tensor) -> bytes:
    """Bytes another process on this host turns back into the same GPU memory."""
    from torch.multiprocessing.reductions import reduce_tensor

    return pickle.dumps(("cuda", reduce_tensor(tensor)))


def shared_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def shared_cpu_buffer(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, bytes, Path]:
    """A CPU tensor backed by a new shared-memory file, the handle that maps it elsewhere, and the file."""
    path = shared_dir() / f"rlhf-ipc-{os.getpid()}-{uuid.uuid4().hex}"
    tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
    return tensor, pickle.dumps(("file", str(path), numel, str(dtype).removeprefix("torch."))), path


def open_handle(handle: bytes) -> torch.Tensor:
    kind, *payload = pickle.loads(handle)
    if kind == "cuda":  # pragma: no cover - GPU branch
        rebuild, args = payload[0]
        return rebuild(*with_this_device(rebuild, args))
    path, numel, dtype = payload
    return torch.from_file(path, shared=True, size=numel, dtype=getattr(torch, dtype))


def remove_orphans(directory: Path | None = None) -> list[Path]:
    """Unlink the buffer files of senders that are no longer running (killed before they unlinked)."""
    removed = []
    for path in (directory or shared_dir()).glob("rlhf-ipc-*-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not pid_alive(int(pid)):
            try:
                path.unlink()
            except OSError:  # another user's file, or removed meanwhile
                continue
            removed.append(path)
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def with_this_device(rebuild: Any, args: tuple) -> list:
    """``rebuild``'s arguments with its ``storage_device`` (the sender's device index, which means
    nothing in this process) replaced by this process's current GPU, found by name in its signature."""
    import inspect

    names = list(inspect.signature(rebuild).parameters)
    if "storage_device" not in names:
        raise RuntimeError(f"{getattr(rebuild, '__name__', rebuild)} takes no storage_device; this torch's CUDA IPC "
                           "handles are not the kind the ipc sync method opens")
    args = list(args)
    args[names.index("storage_device")] = torch.cuda.current_device()
    return args


class IPCSender:
    """Lives in the learner's rank 0: the shared buffers and their handles."""

    def __init__(self) -> None:
        self.buffers: list[tuple[Bucket, torch.Tensor, bytes]] = []
        self.linked: list[Path] = []  # files not yet mapped by every engine
        remove_orphans()

    def _buffer(self, index: int, bucket: Bucket, device: torch.device) -> tuple[torch.Tensor, bytes]:
        if index < len(self.buffers):
            old, buf, handle = self.buffers[index]
            if old.names == bucket.names and old.shapes == bucket.shapes and old.dtype == bucket.dtype:
                return buf, handle
        if device.type == "cpu":
            buf, handle, path = shared_cpu_buffer(bucket.numel, bucket.torch_dtype)
            self.linked.append(path)
        else:  # pragma: no cover - GPU branch
            buf = torch.empty(bucket.numel, dtype=bucket.torch_dtype, device=device)
            handle = ipc_handle(buf)
        entry = (bucket, buf, handle)
        if index < len(self.buffers):
            self.buffers[index] = entry
        else:
            self.buffers.append(entry)
        return buf, handle

    def send(self, named: Iterable[tuple[str, torch.Tensor]], engines: list[Any], size: int,
             fresh: bool = False) -> dict[str, Any]:
        """Fill the buffers and hand them to ``engines``; ``fresh`` (new engines, e.g. restarted ones)
        makes new buffers, since the files of the old ones are gone once mapped."""
        if fresh:
            self.buffers = []
        try:
            return self._send(named, engines, size)
        finally:
            self.unlink()

    def unlink(self) -> None:
        while self.linked:
            self.linked.pop().unlink(missing_ok=True)

    def _send(self, named: Iterable[tuple[str, torch.Tensor]], engines: list[Any], size: int) -> dict[str, Any]:
        futures, tensors, nbytes = [], 0, 0
        for index, (bucket, parts) in enumerate(buckets(named, size)):
            buf, handle = self._buffer(index, bucket, parts[0].device)
            offset = 0
            for part in parts:
                buf[offset : offset + part.numel()].copy_(part)
                offset += part.numel()
            futures += [endpoint.submit(_receive, bucket, handle, index) for endpoint in engines]
            tensors += len(bucket.names)
            nbytes += buf.numel() * buf.element_size()
        futures += [endpoint.submit(commit) for endpoint in engines]
        engines[0].wait(futures)  # buffers are rewritten only after every engine has read them
        return {"tensors": tensors, "bytes": nbytes, "buckets": len(self.buffers), "rpcs": len(futures)}


def _worker_receive(worker: ModelWorker, bucket: Bucket, handle: bytes, index: int) -> int:
    """Open each buffer once (kept open: closing the last mapping frees it); alias it when the
    worker can, else queue its tensors for the commit. Returns how many tensors will be copied."""
    opened = worker.state.setdefault(KEY, {})
    entry = opened.get(index)
    if entry is None or entry[0] != handle:
        flat = open_handle(handle)
        entry = opened[index] = (handle, flat, share_weights(worker, bucket.unpack(flat)))
    if entry[2]:
        return 0
    pending(worker).extend(bucket.unpack(entry[1]))
    return len(bucket.names)


def _receive(ctx: RankContext, bucket: Bucket, handle: bytes, index: int) -> int:
    return sum(on_model_workers(ctx.backend, _worker_receive, bucket, handle, index))


def _send(ctx: RankContext, engines: list[Any], size: int, fresh: bool) -> dict[str, Any]:
    """Every learner rank iterates the weights (ZeRO-3 gathers are collective); rank 0 writes
    them into the shared buffers."""
    named = ctx.backend.named_weights()
    if ctx.rank != 0:
        for _ in named:
            pass
        return {}
    sender = ctx.state.get(KEY)
    if sender is None:
        sender = ctx.state[KEY] = IPCSender()
    return sender.send(named, engines, size, fresh)


class IPCSync:
    def __init__(self, config: Any) -> None:
        self.bucket_bytes = bucket_bytes(config)
        self.engines: list[Any] | None = None

    def sync(self, actor: Any, engine: Any, step: int) -> dict[str, Any]:
        fresh = self.engines is None
        if fresh:
            check_names(actor.weight_shapes(), engine.weight_shapes())
            self.engines = engine.endpoints()
        return actor.run(_send, self.engines, self.bucket_bytes, fresh)[0]
