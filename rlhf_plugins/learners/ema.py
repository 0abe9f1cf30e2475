"""An exponential moving average of the policy's weights (``--learner.ema``, OpenRLHF's
``--enable_ema`` / ``--ema_beta``): after every optimizer update ``ema = beta x ema + (1 - beta) x
weights`` over the trainable parameters, and the final model is saved from the average instead of
the last weights, as OpenRLHF saves its EMA model.

Whatever the learner, each rank averages the part of every trainable parameter it holds: the whole
tensor (torch learner; DeepSpeed ZeRO 0-2), its ZeRO-3 partition (``ds_tensor``) or its FSDP2 shard
(the DTensor's local tensor). The average is kept in float32 (4 bytes per trainable parameter and
rank, divided by the shards): in 16 bits, ``(1 - beta) x`` a small update rounds away. To save, each
rank swaps its average into those tensors, the learner's own ``save`` writes the model (gathering
shards as it always does), and the weights come back. The average goes into checkpoints with each
rank's counters, so a resumed run continues it exactly.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def local_part(param: torch.Tensor) -> torch.Tensor:
    """The storage of ``param`` this rank holds: a ZeRO-3 partition, an FSDP2 shard, or the tensor."""
    part = getattr(param, "ds_tensor", None)
    if part is not None:
        return part
    to_local = getattr(param.data, "to_local", None)
    return to_local() if callable(to_local) else param.data


class WeightAverage:
    """The float32 moving average of ``targets`` (this rank's parts of the trainable parameters),
    updated from ``sources`` (the same values in their most exact form: float32 masters when the
    learner keeps them)."""

    def __init__(self, targets: list[torch.Tensor], beta: float, sources: list[torch.Tensor] | None = None) -> None:
        self.targets, self.beta = targets, beta
        self.sources = sources if sources is not None else targets
        self.average = [t.detach().to(torch.float32, copy=True) for t in self.sources]
        self.float32 = all(s.dtype == torch.float32 for s in self.sources)

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer update: ``average += (1 - beta) x (weights - average)``, in one multi-tensor
        kernel from float32 sources; 16-bit ones one tensor at a time (each widened, no model-sized copy)."""
        if self.float32:
            torch._foreach_lerp_(self.average, [s.detach() for s in self.sources], 1.0 - self.beta)
            return
        for a, s in zip(self.average, self.sources):
            a.lerp_(s.detach().float(), 1.0 - self.beta)

    @torch.no_grad()
    def swapped_in(self, save: Callable[[], Any]) -> Any:
        """Call ``save`` with the average in the weights' place, then put the weights back."""
        kept = [t.detach().clone() for t in self.targets]
        try:
            for t, a in zip(self.targets, self.average):
                t.copy_(a)
            return save()
        finally:
            for t, k in zip(self.targets, kept):
                t.copy_(k)

    def state(self) -> list[torch.Tensor]:
        return [a.cpu() for a in self.average]

    @torch.no_grad()
    def load(self, saved: list[torch.Tensor]) -> None:
        if len(saved) != len(self.average):
            raise ValueError(f"the checkpoint's weight average has {len(saved)} tensors, this learner "
                             f"{len(self.average)}")
        for a, s in zip(self.average, saved):
            a.copy_(s)
