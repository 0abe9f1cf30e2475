"""Builtin weight sync ``broadcast`` (bucketed broadcast from learner rank 0 to every
engine worker) and ``ipc`` (shared buffers by CUDA IPC / shared-memory handle, colocated)."""
from __future__ import annotations

from typing import Any, Iterable

from .._lazy import Lazy
from .._markers import hookimpl
from ..errors import ConfigError
from ..types import WeightSyncMethod


@hookimpl
def rlhf_configure(config: Any) -> None:
    if config.sync.method == "ipc" and config.placement.strategy == "ray" and config.section("ray").colocate != "all":
        raise ConfigError("weight sync 'ipc' needs the engine on the learner's node and GPU: use --ray.colocate all "
                          "(or --sync.method broadcast)")


@hookimpl
def rlhf_weight_sync_methods() -> Iterable[WeightSyncMethod]:
    yield WeightSyncMethod(
        "broadcast",
        factory=Lazy("rlhf_plugins.sync.broadcast:BroadcastSync"),
        description="buckets of weights over a process group (NCCL on GPU, gloo on CPU); one call per bucket",
        same_process=False,
    )
    yield WeightSyncMethod(
        "ipc",
        factory=Lazy("rlhf_plugins.sync.ipc:IPCSync"),
        description="colocated: shared buffers by CUDA IPC / shared-memory handle, zero-copy where possible",
        same_process=False,
    )
