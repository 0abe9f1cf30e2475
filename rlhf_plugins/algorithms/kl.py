"""KL(policy || reference) estimators per token (Schulman's k1, k2, k3), from
log-probs of the sampled tokens.

One convention for all three (as OpenRLHF): the estimate is clamped to
``[-CLAMP, CLAMP]``; k3 also caps its log ratio ``log(q/p)`` at ``CLAMP`` so that its
``exp`` cannot overflow. Tokens outside the clamp get no gradient.
"""
from __future__ import annotations

import math

import torch

#: bound of every estimate (and of k3's log ratio)
CLAMP = 10.0
#: the largest importance weight pi / pi_old of the unbiased KL gradient (OpenRLHF's KL_IS_WEIGHT_CLIP)
IS_WEIGHT_CAP = 10.0


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """log(p/q): unbiased, high variance, can be negative."""
    return (logprobs - ref_logprobs).clamp(-CLAMP, CLAMP)


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """0.5 * log(p/q)^2: biased, low variance, non-negative."""
    return (0.5 * (logprobs - ref_logprobs) ** 2).clamp(-CLAMP, CLAMP)


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """q/p - 1 - log(q/p): unbiased, non-negative."""
    log_ratio = (ref_logprobs - logprobs).clamp(max=CLAMP)
    return (log_ratio.exp() - 1 - log_ratio).clamp(-CLAMP, CLAMP)


def ratio_weights(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The policy ratio ``pi / pi_old`` that weights the KL term (``--algo.kl.ratio``; DeepSeek-V3.2's
    unbiased KL gradient, TRL's ``use_bias_correction_kl``), differentiable: per token, or one per
    sequence from its mean log ratio (GSPO's sequence level), broadcast to its tokens. Log ratios are
    capped at ``CLAMP`` so the ``exp`` cannot overflow."""
    log_ratio = logprobs - old_logprobs
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    return log_ratio.clamp(-CLAMP, CLAMP).exp()


def unbiased_term(kl: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                  old_logprobs: torch.Tensor) -> torch.Tensor:
    """``kl`` (any estimator's) in value; in the backward pass the reverse-KL gradient
    ``w * log(p/q) * grad log p`` with ``w = p / p_old`` capped at :data:`IS_WEIGHT_CAP` and held constant,
    the same for k1, k2 and k3 (``--algo.kl.unbiased_gradient``, OpenRLHF's): the straight-through
    surrogate ``w * log(p/q)^2 / 2``, whose gradient that is."""
    weight = (logprobs - old_logprobs).detach().clamp(max=math.log(IS_WEIGHT_CAP)).exp()
    surrogate = weight * 0.5 * (logprobs - ref_logprobs) ** 2
    return kl.detach() + surrogate - surrogate.detach()
