"""Masked reductions shared by every estimator and loss."""
from __future__ import annotations

import torch

from . import AGGREGATIONS


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    x = x * mask
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)


def masked_extreme(x: torch.Tensor, keep: torch.Tensor, largest: bool) -> torch.Tensor:
    """The largest (or smallest) entry of ``x`` where ``keep``, 0 where nothing is kept -- read on the device
    (no boolean indexing, no host sync), so a loss can log it between a forward and its backward."""
    fill = float("-inf") if largest else float("inf")
    value = x.detach().masked_fill(~keep, fill)
    value = value.max() if largest else value.min()
    return torch.where(torch.isfinite(value), value, torch.zeros_like(value))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, shift_mean: bool = True) -> torch.Tensor:
    """Normalise the masked entries of ``x`` to zero mean, unit (unbiased) variance."""
    mean = masked_mean(x, mask)
    n = mask.sum().clamp(min=2)
    var = masked_sum((x - mean) ** 2, mask) / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, top: float) -> torch.Tensor:
    """1 on the tokens of ``mask`` whose entropy is at least the ``1 - top`` quantile of the masked
    entropies (TRL's ``get_high_entropy_mask``, over one rank's micro batch), 0 elsewhere."""
    keep = mask.bool()
    # torch.quantile's linear rule over the masked values, without selecting them: a boolean selection's
    # size is read on the host, which on a GPU waits for the forward to finish before the backward is issued
    ordered = torch.where(keep, entropy.float(), torch.inf).flatten().sort().values
    rank = (1 - top) * (keep.sum() - 1).clamp(min=0)
    below, above = rank.floor().long(), rank.ceil().long()
    threshold = torch.lerp(ordered[below.view(1)], ordered[above.view(1)], rank - below)
    return ((entropy >= threshold) & keep).to(mask.dtype)


def nonempty(mask: torch.Tensor) -> torch.Tensor:
    """How many sequences of ``mask`` have at least one token (empty completions do not count
    in sequence means)."""
    return (mask.sum(-1) > 0).sum()


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, norm: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    token-mean: every token of the batch weighs the same (DAPO).
    seq-mean-token-mean: mean over each sequence's tokens, then over sequences (GRPO paper).
    seq-mean-token-sum: sum over each sequence's tokens, then mean over sequences.
    seq-mean-token-sum-norm: token sum divided by the constant ``norm`` -- the generation
    budget, never the padded width of the batch -- then mean over sequences (Dr. GRPO).

    Sequence means count only sequences with at least one token.
    """
    if mode == "token-mean":
        return masked_mean(loss, mask)
    seqs = nonempty(mask).clamp(min=1)
    if mode == "seq-mean-token-mean":
        return masked_mean(loss, mask, dim=-1).sum() / seqs
    if mode == "seq-mean-token-sum":
        return masked_sum(loss, mask, dim=-1).sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        if norm is None or norm <= 0:
            raise ValueError("loss aggregation 'seq-mean-token-sum-norm' needs a constant length norm > 0 "
                             "(the generation budget)")
        return (masked_sum(loss, mask, dim=-1) / norm).sum() / seqs
    raise ValueError(f"unknown loss aggregation '{mode}'; choose one of: {', '.join(AGGREGATIONS)}")


def micro_batch_weight(micro_mask: torch.Tensor, mini_mask: torch.Tensor, mode: str) -> float:
    """Share of a micro batch in its mini batch, so that accumulated gradients equal
    the gradient of the mini batch aggregated at once."""
    if mode == "token-mean":
        return float(micro_mask.sum()) / max(float(mini_mask.sum()), 1.0)
    return float(nonempty(micro_mask)) / max(float(nonempty(mini_mask)), 1.0)

