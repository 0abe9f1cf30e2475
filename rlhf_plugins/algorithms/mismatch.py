"""Rollout / training mismatch correction.

The generation engine (vLLM, another dtype, another kernel) samples from a policy
that differs slightly from the learner's. With the engine's log-probs of the
sampled tokens, the per-token loss is reweighted by ``r = pi_learner / pi_engine``:

* ``tis``: truncated importance sampling, ``w = min(r, high)`` -- or ``clamp(r, floor, high)``
  with a floor > 0 (OpenRLHF's band is [0.5, 5]; the default floor 0 is the TIS paper's estimator).
* ``icepop``: keep tokens whose ``r`` lies in ``[low, high]`` with weight ``r``,
  drop the others (weight 0).
* ``seq_icepop``: drop whole sequences whose geometric-mean ratio leaves ``[low, high]``; the kept
  ones keep their raw token ratios as weights (OpenRLHF's seq-mask-tis and ``is_correction_level seq``).
* ``seq_mask_tis``: the same gate, the kept sequences' token weights capped at ``high`` (so one token
  with a wild ratio inside a kept sequence cannot dominate).
* ``seq_tis`` / ``seq_mask``: one weight per sequence, the product of its token ratios, clamped to
  ``[floor, high]`` / zero outside ``[low, high]`` (TRL's ``sequence_truncate`` / ``sequence_mask``,
  the latter TRL's default with vLLM).

Metrics: the mean ratio, the share of tokens dropped, the mean and largest |log ratio|, the weights' smallest,
mean and largest (per sequence for ``seq_tis`` / ``seq_mask``; TRL's ``sampling/*``), and for the sequence gates
the share of sequences dropped (``mismatch/dropped_seq_frac``).

``icepop`` and ``seq_icepop`` gate on the ratio by default; ``gate`` ``binary_kl`` / ``tv`` gates them
instead on a divergence between the engine's and the learner's probabilities of the sampled token ``p``,
``q`` (each clamped to [1e-6, 1 - 1e-6]): ``p log(p/q) + (1-p) log((1-p)/(1-q))`` or ``|p - q|``, per
token or its mean over the sequence, kept up to ``max_divergence`` (OpenRLHF's
``--algo.advantage.is_correction_gating``; FlashREINFORCE's trust region). Weights carry no gradient.
"""
from __future__ import annotations

import torch

from .numerics import masked_extreme, masked_mean

MODES = ("none", "tis", "icepop", "seq_icepop", "seq_mask_tis", "seq_tis", "seq_mask")
#: the statistics icepop and seq_icepop can gate on
GATES = ("ratio", "binary_kl", "tv")


def importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    low: float,
    high: float,
    floor: float = 0.0,
    gate: str = "ratio",
    max_divergence: float = 0.005,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_ratio = (old_logprobs - rollout_logprobs).detach() * mask
    ratio = log_ratio.clamp(-20, 20).exp()
    if mode == "tis":
        weights = ratio.clamp(min=floor, max=high)
        dropped = torch.zeros_like(ratio)
    elif mode in ("icepop", "seq_icepop", "seq_mask_tis"):
        per_sequence = mode != "icepop"
        if gate == "ratio":
            keep = _ratio_kept(log_ratio, mask, per_sequence, low, high)
        else:
            keep = _divergence(old_logprobs, rollout_logprobs, mask, per_sequence, gate) <= max_divergence
        keep = keep.to(ratio.dtype)
        weights = (ratio.clamp(max=high) if mode == "seq_mask_tis" else ratio) * keep
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
        raise ValueError(f"unknown mismatch correction '{mode}'; choose one of: {', '.join(MODES)}")
    metrics = {
        "mismatch/ratio_mean": masked_mean(ratio, mask),
        "mismatch/dropped_frac": masked_mean(dropped, mask),
        "mismatch/abs_log_ratio": masked_mean(log_ratio.abs(), mask),
        **_spread(log_ratio, weights, mask, per_sequence=mode in ("seq_tis", "seq_mask")),
    }
    if mode in ("seq_icepop", "seq_mask_tis", "seq_mask"):  # whole sequences dropped (OpenRLHF's is_filter_ratio,
        rows = (mask.sum(-1) > 0).to(ratio.dtype)         # FlashREINFORCE's 1 - acceptance_rate)
        metrics["mismatch/dropped_seq_frac"] = masked_mean(dropped[:, 0], rows)
    return weights * mask, metrics


def _spread(log_ratio: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor,
            per_sequence: bool) -> dict[str, torch.Tensor]:
    """What TRL logs of its vLLM importance sampling (``sampling/*``): the largest |log ratio| of a completion
    token, and the weights' smallest, mean and largest -- over the tokens, or over the sequences where the
    weight is one per sequence; 0 in a batch without completion tokens. Read on the device (no host sync)."""
    kept = mask > 0
    if per_sequence:  # each sequence's one weight, on every one of its tokens
        values, keep = (weights * mask).sum(-1) / mask.sum(-1).clamp(min=1), kept.any(-1)
    else:
        values, keep = weights, kept
    return {"mismatch/abs_log_ratio_max": masked_extreme(log_ratio.abs(), kept, True),
            "mismatch/weight_min": masked_extreme(values, keep, False),
            "mismatch/weight_mean": masked_mean(values, keep.to(values.dtype)),
            "mismatch/weight_max": masked_extreme(values, keep, True)}


def weights_for(options, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`importance_weights` with the policy-loss section's settings (``algo.policy_loss``)."""
    return importance_weights(old_logprobs, rollout_logprobs, mask, options.mismatch, options.mismatch_low,
                              options.mismatch_high, options.tis_floor, options.mismatch_gate,
                              options.mismatch_max_divergence)


def _ratio_kept(log_ratio: torch.Tensor, mask: torch.Tensor, per_sequence: bool, low: float,
                high: float) -> torch.Tensor:
    """Whether each token's ratio -- or its sequence's geometric-mean ratio -- lies in [low, high]."""
    stat = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1) if per_sequence else log_ratio
    stat = stat.clamp(-20, 20).exp()
    return (stat >= low) & (stat <= high)


def _divergence(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                per_sequence: bool, gate: str) -> torch.Tensor:
    """The sampled token's binary KL or total variation between the engine (p) and the learner (q), per
    token or its mean over the sequence."""
    p = rollout_logprobs.detach().exp().clamp(1e-6, 1 - 1e-6)
    q = old_logprobs.detach().exp().clamp(1e-6, 1 - 1e-6)
    if gate == "binary_kl":
        stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    elif gate == "tv":
        stat = (p - q).abs()
    else:
        raise ValueError(f"unknown mismatch gate '{gate}'; choose one of: {', '.join(GATES)}")
    return masked_mean(stat, mask, dim=-1).unsqueeze(-1) if per_sequence else stat
