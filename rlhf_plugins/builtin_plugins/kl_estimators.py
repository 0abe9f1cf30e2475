"""Builtin KL estimators (``--algo.kl.estimator``)."""
from __future__ import annotations

from collections.abc import Iterable

from .._lazy import Lazy
from .._markers import hookimpl
from ..types import KLEstimator

_M = "rlhf_plugins.algorithms.kl"


@hookimpl
def rlhf_kl_estimators() -> Iterable[KLEstimator]:
    yield KLEstimator("k1", Lazy(f"{_M}:k1"), description="log(p/q): unbiased, high variance")
    yield KLEstimator("k2", Lazy(f"{_M}:k2"), description="0.5 log(p/q)^2: low variance, biased")
    yield KLEstimator("k3", Lazy(f"{_M}:k3"), description="q/p - 1 - log(q/p): unbiased, non-negative (clamped)")
