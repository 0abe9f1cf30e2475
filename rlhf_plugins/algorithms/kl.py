"""KL(policy || reference) estimators per token (Schulman's k1, k2, k3), from
log-probs of the sampled tokens.

One convention for all three (as OpenRLHF): the estimate is clamped to
``[-CLAMP, CLAMP]``; k3 also caps its log ratio ``log(q/p)`` at ``CLAMP`` so that its
``exp`` cannot overflow. Tokens outside the clamp get no gradient.
"""
from __future__ import annotations

import torch

#: bound of every estimate (and of k3's log ratio)
CLAMP = 10.0


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
