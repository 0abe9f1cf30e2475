"""Builtin advantage estimators (``--algo.advantage.estimator``)."""
from __future__ import annotations

from collections.abc import Iterable

from .._lazy import Lazy
from .._markers import hookimpl
from ..types import AdvantageEstimator

_M = "rlhf_plugins.algorithms.advantages"


@hookimpl
def rlhf_advantage_estimators() -> Iterable[AdvantageEstimator]:
    yield AdvantageEstimator("gae", Lazy(f"{_M}:gae"), needs_critic=True,
                             description="PPO: generalised advantage estimation with a critic")
    yield AdvantageEstimator("reinforce", Lazy(f"{_M}:reinforce"),
                             description="REINFORCE++: token returns with KL in the reward, global whitening")
    yield AdvantageEstimator("reinforce_baseline", Lazy(f"{_M}:reinforce_baseline"), needs_groups=True,
                             description="REINFORCE++-baseline: group-mean baseline, then global whitening")
    yield AdvantageEstimator("group_norm", Lazy(f"{_M}:group_norm"), needs_groups=True,
                             description="GRPO: score normalised by its group's mean and std")
    yield AdvantageEstimator("dr_grpo", Lazy(f"{_M}:dr_grpo"), needs_groups=True,
                             description="Dr. GRPO: score minus group mean, no std division")
    yield AdvantageEstimator("group_mean_batch_std", Lazy(f"{_M}:group_mean_batch_std"), needs_groups=True,
                             description="score minus group mean over the batch's score std (TRL's "
                                         "scale_rewards='batch')")
    yield AdvantageEstimator("rloo", Lazy(f"{_M}:rloo"), needs_groups=True,
                             description="RLOO: leave-one-out group baseline")
    yield AdvantageEstimator("batch_mean", Lazy(f"{_M}:batch_mean"),
                             description="FlashREINFORCE: score minus the batch's mean score, one sample per prompt "
                                         "enough")
