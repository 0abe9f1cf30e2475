"""The critic's objective: clipped value loss (PPO)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .numerics import masked_mean, micro_batch_weight


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> torch.Tensor:
    """Per-token 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)."""
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.max(loss, (clipped - returns) ** 2)
    return 0.5 * loss


@dataclass
class ValueObjective:
    clip: float | None = 0.2
    needs_entropy = False

    def weight(self, micro_mask: torch.Tensor, mini_mask: torch.Tensor) -> float:
        return micro_batch_weight(micro_mask, mini_mask, "token-mean")

    def __call__(self, outputs: dict[str, torch.Tensor], batch: dict[str, Any]) -> tuple[torch.Tensor, dict]:
        mask = batch["action_mask"].to(outputs["values"].dtype)
        values = outputs["values"]
        per_token = clipped_value_loss(values, batch["values"], batch["returns"], self.clip)
        loss = masked_mean(per_token, mask)
        metrics = {
            "critic/loss": loss.detach(),
            "critic/values": masked_mean(values.detach(), mask),
        }
        if self.clip is not None:
            clipped = ((values - batch["values"]).abs() > self.clip).to(mask.dtype)
            metrics["critic/clip_frac"] = masked_mean(clipped, mask)
        return loss, metrics
