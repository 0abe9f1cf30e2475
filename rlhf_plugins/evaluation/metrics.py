"""Evaluation metrics over ``n`` scored samples per prompt.

A sample is correct when its score is at least ``threshold`` (1.0 for exact-match rewards).

* ``pass@k`` -- the unbiased estimator of Chen et al. (2021): ``1 - C(n - c, k) / C(n, k)`` per
  prompt with ``c`` correct samples out of ``n``, averaged over prompts (never the biased
  "best of the first k").
* ``mean@k`` -- the mean score of the samples.
* ``maj@k`` -- the majority answer among ``k`` samples is correct (answers compared after
  extraction; ties broken towards the answer seen first).
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from math import comb
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(completion: str) -> str | None:
    """The builtin answer extraction: the first number of the first line (``"12.0 apples"`` ->
    ``"12"``), else the first line; ``None`` for an empty completion."""
    line = completion.strip().split("\n", 1)[0].strip()
    found = _NUMBER.match(line)
    if found:
        value = float(found.group())
        return str(int(value)) if value.is_integer() else str(value)
    return line or None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n`` with
    ``c`` correct is correct."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n; got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def majority(answers: Sequence[Any]) -> Any:
    """The most frequent answer (``None`` answers do not vote); the first seen wins a tie."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    best = max(votes.values())
    return next(a for a in answers if a is not None and votes[a] == best)


def summarise(scores: list[list[float]], answers: list[list[Any]] | None, labels: list[Any] | None, k: int,
              threshold: float = 1.0) -> dict[str, float]:
    """pass@1, pass@k, mean@k and (with answers and labels) maj@k over prompts (``scores[i]``: the
    ``n`` samples of prompt i; ``k`` is capped at ``n``)."""
    if not scores:
        return {}
    n = len(scores[0])
    k = min(k, n)
    correct = [sum(s >= threshold for s in row) for row in scores]
    out = {
        "pass@1": sum(pass_at_k(n, c, 1) for c in correct) / len(scores),
        f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(scores),
        f"mean@{k}": sum(sum(row[:k]) / k for row in scores) / len(scores),
    }
    if answers is not None and labels is not None:
        maj = [majority(a[:k]) for a in answers]
        out[f"maj@{k}"] = sum(m is not None and str(m) == str(lb).strip() for m, lb in zip(maj, labels)) / len(scores)
    return out
