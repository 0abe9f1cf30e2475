"""Where a role computes: its GPU when it has one, else the CPU -- and batches moved there and back.

Roles exchange CPU tensors (they cross processes and Ray's object store); each role moves what it
receives to its own device and hands results back on the CPU. Under Ray each role actor sees only
its own GPUs (``CUDA_VISIBLE_DEVICES``); several ranks in one process group on one machine pick
theirs by ``LOCAL_RANK``.
"""
from __future__ import annotations

import os
from typing import Any

import torch


def role_device() -> torch.device:
    """This process's compute device: ``cuda:<LOCAL_RANK mod visible GPUs>`` with a GPU, else the CPU
    (``RLHF_DEVICE=cpu`` keeps a GPU machine's roles on the CPU)."""
    if os.environ.get("RLHF_DEVICE", "").lower() == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch with every tensor on ``device`` (the same dict when it is already there)."""
    if all(not torch.is_tensor(v) or v.device == device for v in batch.values()):
        return batch
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def on_cpu(value: Any) -> Any:
    """A role's result as it leaves the role: tensors on the CPU."""
    if torch.is_tensor(value):
        return value.cpu()
    if isinstance(value, dict):
        return {k: on_cpu(v) for k, v in value.items()}
    return value
