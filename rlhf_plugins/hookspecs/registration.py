"""Registration hooks: a plugin adds components to an area of the RL loop.

Each hook is *collecting*: every plugin that implements it contributes, and each
implementation returns (usually yields) dataclasses of the area's type. They are
called once, when the manager builds its component registry at start-up; the
config then picks components by name. Two plugins registering the same name in
one area is an error naming both.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .._markers import hookspec

if TYPE_CHECKING:
    from ..types import (
        AdvantageEstimator,
        Environment,
        GenerationBackend,
        KLEstimator,
        LearnerBackend,
        PlacementStrategy,
        PolicyLoss,
        RewardFunction,
        WeightSyncMethod,
    )


@hookspec
def rlhf_placement_strategies() -> Iterable[PlacementStrategy]:
    """Register placement strategies (``--placement.strategy NAME``).

    Called once at start-up; collecting. Return an iterable of
    :class:`~rlhf_plugins.PlacementStrategy`; ``factory(ctx: PlacementContext)`` returns a
    :class:`~rlhf_plugins.Placement`.

    Example::

        @hookimpl
        def rlhf_placement_strategies():
            yield PlacementStrategy("slurm", factory=SlurmPlacement, same_process=False, multi_rank=True,
                                    default_sync="broadcast")
    """


@hookspec
def rlhf_generation_backends() -> Iterable[GenerationBackend]:
    """Register generation backends (``--generation.backend NAME``).

    Called once at start-up; collecting. Return an iterable of
    :class:`~rlhf_plugins.GenerationBackend`; ``factory(ctx: BackendContext)`` returns a
    :class:`~rlhf_plugins.GenerationEngine`.

    Example::

        @hookimpl
        def rlhf_generation_backends():
            yield GenerationBackend("sglang", factory=SGLangEngine, requires=("sglang",))
    """


@hookspec
def rlhf_reward_functions() -> Iterable[RewardFunction]:
    """Register reward functions (``--reward.functions NAME[,NAME...]``).

    Called once at start-up; collecting. Return an iterable of
    :class:`~rlhf_plugins.RewardFunction`. A function has TRL's signature
    ``(prompts, completions, **kwargs) -> list[float | None]``.

    Example::

        def brevity(prompts, completions, **kwargs):
            return [-len(c) / 100 for c in completions]

        @hookimpl
        def rlhf_reward_functions():
            yield RewardFunction("brevity", brevity)
    """


@hookspec
def rlhf_advantage_estimators() -> Iterable[AdvantageEstimator]:
    """Register advantage estimators (``--algo.advantage.estimator NAME``).

    Called once at start-up; collecting. Return an iterable of
    :class:`~rlhf_plugins.AdvantageEstimator`; ``compute`` receives an
    :class:`~rlhf_plugins.AdvantageInputs` and returns ``(advantages, returns)``.

    Example::

        @hookimpl
        def rlhf_advantage_estimators():
            yield AdvantageEstimator("raw", compute=lambda x: (x.token_rewards(), x.token_rewards()))
    """


@hookspec
def rlhf_policy_losses() -> Iterable[PolicyLoss]:
    """Register policy losses (``--algo.policy_loss.name NAME``).

    Called once at start-up; collecting. Return an iterable of
    :class:`~rlhf_plugins.PolicyLoss`; ``compute(inputs, options)`` returns a
    per-token loss ``[B, T]`` and a dict of metrics.

    Example::

        @hookimpl
        def rlhf_policy_losses():
            yield PolicyLoss("vanilla_pg", compute=lambda x, o: (-x.advantages * x.logprobs, {}))
    """


@hookspec
def rlhf_kl_estimators() -> Iterable[KLEstimator]:
    """Register KL estimators (``--algo.kl.estimator NAME``).

    Called once at start-up; collecting. Return an iterable of
    :class:`~rlhf_plugins.KLEstimator`; ``compute(logprobs, ref_logprobs)``
    returns a per-token estimate ``[B, T]``.

    Example::

        @hookimpl
        def rlhf_kl_estimators():
            yield KLEstimator("abs", compute=lambda lp, ref: (lp - ref).abs())
    """


@hookspec
def rlhf_learner_backends() -> Iterable[LearnerBackend]:
    """Register learner backends (``--learner.backend NAME``).

    Called once at start-up; collecting. Return an iterable of
    :class:`~rlhf_plugins.LearnerBackend`; ``factory(ctx: BackendContext)`` returns a
    :class:`~rlhf_plugins.Learner`.

    Example::

        @hookimpl
        def rlhf_learner_backends():
            yield LearnerBackend("megatron", factory=MegatronLearner, requires=("megatron",), multi_rank=True)
    """


@hookspec
def rlhf_weight_sync_methods() -> Iterable[WeightSyncMethod]:
    """Register weight-sync methods (``--sync.method NAME``).

    Called once at start-up; collecting. Return an iterable of
    :class:`~rlhf_plugins.WeightSyncMethod`; ``factory(config)`` returns a
    :class:`~rlhf_plugins.WeightSync`.

    Example::

        @hookimpl
        def rlhf_weight_sync_methods():
            yield WeightSyncMethod("disk", factory=DiskSync, same_process=False)
    """


@hookspec
def rlhf_environments() -> Iterable[Environment]:
    """Register multi-turn environments (``--env.name NAME``, or per row by ``--env.column``).

    Called once at start-up; collecting. Return an iterable of
    :class:`~rlhf_plugins.Environment`; ``factory()`` returns one instance per trajectory, a TRL
    environment class (public methods are tools, ``reset``, optional ``get_reward``) or an
    OpenRLHF ``AgentInstance`` (async ``reset`` / ``step``).

    Example::

        class Shell:
            def reset(self, **row):
                self.cwd = "/"

            def ls(self, path: str) -> str:
                '''List a folder.

                Args:
                    path: the folder
                '''
                return "a.txt b.txt"

        @hookimpl
        def rlhf_environments():
            yield Environment("shell", factory=Shell)
    """
