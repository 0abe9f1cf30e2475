"""What the sharded learners (DeepSpeed ZeRO-3, FSDP2) share: joining the role's process group, and
writing the full model from tensors gathered one at a time, so that no rank holds the whole model."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch


def rank_environment() -> None:
    """The variables a process group is created from: set by the placement for a role's ranks
    (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK); alone under local placement, a world of
    one on a free loopback port (the variables stay set: DeepSpeed keeps reading LOCAL_RANK)."""
    if "RANK" not in os.environ:
        from ..sync.groups import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")


def process_group_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def save_gathered(model: Any, path: str, rank: int, gathered: Callable[[bool], Iterator[tuple[str, torch.Tensor]]],
                  sizes: dict[str, int]) -> None:
    """A ``save_pretrained`` folder written by rank 0 from ``gathered(trainable_only)``, a collective
    iteration every rank runs (each tensor gathered in turn): shard by shard for a whole model
    (``sizes``: name -> bytes, in iteration order), the adapter alone under LoRA."""
    from ..models.folder import ShardWriter, save_pretrained
    from ..models.lora import lora_config_of

    if lora_config_of(model) is not None:  # the adapter alone: gather the trained tensors only
        state = {name: t.cpu() for name, t in gathered(True)}
        if rank == 0:
            save_pretrained(model, path, state_dict=state)
        return
    # a critic (ValueModel): the backbone's tensors under its own names, the head in its own file
    backbone = "backbone." if hasattr(model, "value_head") and hasattr(model, "backbone") else ""
    writer = ShardWriter(path, {n.removeprefix(backbone): s for n, s in sizes.items() if n.startswith(backbone)}) \
        if rank == 0 else None
    head: dict[str, torch.Tensor] = {}
    for name, tensor in gathered(False):
        if writer is None:
            continue
        if name.startswith(backbone):
            writer.add(name.removeprefix(backbone), tensor.cpu())
        else:
            head[name.removeprefix("value_head.")] = tensor.cpu()
    if writer is not None:
        writer.close()
        model.config.save_pretrained(path)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(path)
        if backbone:
            from safetensors.torch import save_file

            from ..models.value_model import HEAD_FILE

            save_file({k: v.contiguous() for k, v in head.items()}, os.path.join(path, HEAD_FILE))
