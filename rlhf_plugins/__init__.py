"""rlhf-plugins: RLHF for large language models in which every part of the RL loop is a plugin.

Plugin authors import everything they need from here::

    from rlhf_plugins import hookimpl, RewardFunction

Importing this package is cheap: no torch, ray, vllm or deepspeed.
"""
from __future__ import annotations

from ._markers import ENTRY_POINT_GROUP, hookimpl, hookspec
from ._version import __version__
from .errors import ConfigError, DataError, PluginError, RewardError, UsageError
from .types import (
    AdvantageEstimator,
    Component,
    GenerationBackend,
    KLEstimator,
    LearnerBackend,
    PlacementStrategy,
    PolicyLoss,
    RewardFunction,
    WeightSyncMethod,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "AdvantageEstimator",
    "Component",
    "ConfigError",
    "DataError",
    "GenerationBackend",
    "KLEstimator",
    "LearnerBackend",
    "PlacementStrategy",
    "PluginError",
    "PolicyLoss",
    "RewardError",
    "RewardFunction",
    "UsageError",
    "WeightSyncMethod",
    "__version__",
    "hookimpl",
    "hookspec",
]
