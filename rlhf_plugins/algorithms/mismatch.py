"""Rollout / training mismatch correction.

The generation engine (vLLM, another dtype, another kernel) samples from a policy
that differs slightly from the learner's. With the engine's log-probs of the
sampled tokens, the per-token loss is reweighted by ``r = pi_learner / pi_engine``:

* ``tis``: truncated importance sampling, ``w = min(r, high)`` -- or ``clamp(r, floor, high)``
  with a floor > 0 (OpenRLHF's band is [0.5, 5]; the default floor 0 is the TIS paper's estimator).
* ``icepop``: keep tokens whose ``r`` lies in ``[low, high]`` with weight ``r``,
  drop the others (weight 0).
* ``seq_mask_tis``: drop whole sequences whose geometric-mean ratio leaves
  ``[low, high]``; the kept ones get token TIS weights (capped at ``high``, where OpenRLHF keeps
  the raw ratio: a kept sequence can still hold one token with a wild ratio).
* ``seq_tis`` / ``seq_mask``: one weight per sequence, the product of its token ratios, clamped to
  ``[floor, high]`` / zero outside ``[low, high]`` (TRL's ``sequence_truncate`` / ``sequence_mask``,
  the latter TRL's default with vLLM).

Weights carry no gradient.
"""
from __future__ import annotations

import torch

from .numerics import masked_mean


def importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    low: float,
    high: float,
    floor: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_ratio = (old_logprobs - rollout_logprobs).detach() * mask
    ratio = log_ratio.clamp(-20, 20).exp()
    if mode == "tis":
        weights = ratio.clamp(min=floor, max=high)
        dropped = torch.zeros_like(ratio)
    elif mode == "icepop":
        keep = ((ratio >= low) & (ratio <= high)).to(ratio.dtype)
        weights = ratio * keep
        dropped = 1 - keep
    elif mode == "seq_mask_tis":
        seq_ratio = masked_mean(log_ratio, mask, dim=-1).exp()
        keep = ((seq_ratio >= low) & (seq_ratio <= high)).to(ratio.dtype)[:, None]
        weights = ratio.clamp(max=high) * keep
        dropped = (1 - keep).expand_as(ratio)
    elif mode in ("seq_tis", "seq_mask"):
        seq_ratio = log_ratio.sum(-1, keepdim=True).clamp(-20, 20).exp()
        if mode == "seq_tis":
            weights, keep = seq_ratio.clamp(min=floor, max=high), torch.ones_like(seq_ratio)
        else:
            keep = ((seq_ratio >= low) & (seq_ratio <= high)).to(ratio.dtype)
            weights = seq_ratio * keep
        weights, dropped = weights.expand_as(ratio), (1 - keep).expand_as(ratio)
    else:
        raise ValueError(f"unknown mismatch correction '{mode}'; choose one of: none, tis, icepop, seq_mask_tis, "
                         "seq_tis, seq_mask")
    metrics = {
        "mismatch/ratio_mean": masked_mean(ratio, mask),
        "mismatch/dropped_frac": masked_mean(dropped, mask),
        "mismatch/abs_log_ratio": masked_mean(log_ratio.abs(), mask),
    }
    return weights * mask, metrics
