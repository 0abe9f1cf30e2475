"""KL(policy || reference) estimators per token (Schulman's k1, k2, k3), from
log-probs of the sampled tokens."""
from __future__ import annotations

import torch


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """log(p/q): unbiased, high variance, can be negative."""
    return logprobs - ref_logprobs


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """0.5 * log(p/q)^2: biased, low variance, non-negative."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, clamp: float = 10.0) -> torch.Tensor:
    """q/p - 1 - log(q/p): unbiased, non-negative; log ratio and result clamped for stability."""
    log_ratio = (ref_logprobs - logprobs).clamp(-clamp, clamp)
    return (log_ratio.exp() - 1 - log_ratio).clamp(max=clamp)
