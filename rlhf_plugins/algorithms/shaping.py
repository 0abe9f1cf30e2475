"""Reward shaping between scoring and advantages: penalties, normalisation, clipping,
and the dynamic filter that drops prompt groups without learning signal."""
from __future__ import annotations

import math
from typing import Any

import torch


class RunningMoments:
    """Mean and variance of every score seen so far (Chan et al. parallel update)."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, xs: list[float]) -> None:
        n = len(xs)
        if n == 0:
            return
        mean = sum(xs) / n
        m2 = sum((x - mean) ** 2 for x in xs)
        delta = mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), state["mean"], state["m2"]


class RewardShaper:
    """scores -> stop / overlong penalties -> running normalisation -> clipping."""

    def __init__(self, cfg: Any, max_new_tokens: int) -> None:
        self.cfg = cfg
        self.max_new_tokens = max_new_tokens
        self.moments = RunningMoments()

    def overlong(self, length: int) -> float:
        buffer = self.cfg.overlong_buffer
        if buffer <= 0:
            return 0.0
        start = self.max_new_tokens - buffer
        if length <= start:
            return 0.0
        if length <= self.max_new_tokens:
            return (start - length) / buffer * self.cfg.overlong_penalty
        return -self.cfg.overlong_penalty

    def truncated(self, score: float) -> float:
        """A completion that did not stop: the stop penalty, then the scale (OpenRLHF's ProRL penalty:
        the score times it, or replaced by it when it is negative)."""
        score -= self.cfg.stop_penalty or 0.0
        scale = self.cfg.truncated_scale
        if scale is None:
            return score
        return score * scale if scale >= 0 else scale

    def __call__(self, scores: list[float], lengths: list[int], finish_reasons: list[str]) -> list[float]:
        c = self.cfg
        out = [s + self.overlong(n) for s, n in zip(scores, lengths)]
        out = [s if reason == "stop" else self.truncated(s) for s, reason in zip(out, finish_reasons)]
        if c.normalize:
            self.moments.update(out)
            std = self.moments.std or 1.0
            out = [(s - self.moments.mean) / (std + 1e-8) for s in out]
        if c.clip is not None:
            low = -c.clip if c.clip_low is None else c.clip_low
            out = [min(max(s, low), c.clip) for s in out]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"moments": self.moments.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.moments.load_state_dict(state["moments"])


def keep_groups(scores: list[float], group_size: int, score_range: list[float] | None) -> list[int]:
    """Indices of prompt groups that carry signal: scores not all equal and, with a
    range ``[low, high]``, a group mean strictly inside it."""
    kept = []
    for g in range(len(scores) // group_size):
        block = scores[g * group_size : (g + 1) * group_size]
        if max(block) - min(block) <= 1e-12:
            continue
        if score_range is not None:
            mean = sum(block) / len(block)
            if not score_range[0] < mean < score_range[1]:
                continue
        kept.append(g)
    return kept


def normalize_then_sum(parts: dict[str, list[float | None]], weights: list[float], group_size: int) -> list[float]:
    """GDPO's combination of several rewards: each source's scores normalised within each prompt
    group, ``(r - mean) / (std + 1e-4)`` (unbiased std over the samples it scored; a source that
    abstained (None) on a sample leaves it out), then summed by weight. A sample no source scored gets 0."""
    terms = []
    for values, weight in zip(parts.values(), weights):
        x = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float64).view(-1, group_size)
        mean = x.nanmean(-1, keepdim=True)
        count = (~x.isnan()).sum(-1, keepdim=True)
        var = ((x - mean) ** 2).nansum(-1, keepdim=True) / (count - 1).clamp(min=1)
        std = torch.where(count > 1, var.sqrt(), torch.zeros_like(var))
        terms.append(weight * (x - mean) / (std + 1e-4))
    return torch.stack(terms).nansum(0).reshape(-1).tolist() if terms else []
