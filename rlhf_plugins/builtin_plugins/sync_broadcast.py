"""Builtin weight sync ``broadcast`` (bucketed broadcast from learner rank 0 to every engine
worker) and ``ipc`` (shared buffers by CUDA IPC / shared-memory handle, colocated)."""
from __future__ import annotations

from collections.abc import Iterable

from .._lazy import Lazy
from .._markers import hookimpl
from ..types import WeightSyncMethod


@hookimpl
def rlhf_weight_sync_methods() -> Iterable[WeightSyncMethod]:
    yield WeightSyncMethod(
        "broadcast",
        factory=Lazy("rlhf_plugins.sync.broadcast:BroadcastSync"),
        description="buckets of weights over a process group (NCCL on GPU, gloo on CPU); one call per bucket",
        same_process=False,
        staging=("generation",),  # received buckets: all of them, or about two where the engine streams
    )
    yield WeightSyncMethod(
        "ipc",
        factory=Lazy("rlhf_plugins.sync.ipc:IPCSync"),
        description="colocated: shared buffers by CUDA IPC / shared-memory handle, zero-copy where possible",
        same_process=False,
        needs_colocation=True,
        staging=("actor",),  # the learner's rank 0 keeps the shared buffers: a whole copy of the weights
    )
