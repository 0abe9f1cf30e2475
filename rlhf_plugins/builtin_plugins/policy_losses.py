"""Builtin policy losses (``--algo.policy_loss.name``)."""
from __future__ import annotations

from collections.abc import Iterable

from .._lazy import Lazy
from .._markers import hookimpl
from ..types import PolicyLoss

_M = "rlhf_plugins.algorithms.policy_losses"


@hookimpl
def rlhf_policy_losses() -> Iterable[PolicyLoss]:
    yield PolicyLoss("ppo", Lazy(f"{_M}:ppo"), description="PPO clipped surrogate, asymmetric and dual clip")
    yield PolicyLoss("gspo", Lazy(f"{_M}:gspo"), description="GSPO: clipped sequence-level importance ratio",
                     default_aggregation="seq-mean-token-mean")
    yield PolicyLoss("sequence_ppo", Lazy(f"{_M}:sequence_ppo"),
                     description="PPO on each completion's ratio, the product of its token ratios (TRL's RLOO)",
                     default_aggregation="seq-mean-token-mean")
    yield PolicyLoss("cispo", Lazy(f"{_M}:cispo"),
                     description="CISPO: REINFORCE weighted by the ratio capped at 1 + clip_high (no token clipped)")
    yield PolicyLoss("vespo", Lazy(f"{_M}:vespo"),
                     description="VESPO: REINFORCE weighted by a gamma-shaped function of the sequence weight")
    yield PolicyLoss("sapo", Lazy(f"{_M}:sapo"), description="SAPO: a sigmoid gate on the ratio instead of the clip")
