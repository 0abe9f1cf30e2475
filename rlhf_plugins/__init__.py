"""rlhf-plugins: RLHF for large language models in which every part of the RL loop is a plugin.

Plugin authors import everything they need from here -- the markers, the registration
dataclasses, every input and output type their hooks see, and the backend protocols::

    from rlhf_plugins import hookimpl, RewardFunction, setting
    from rlhf_plugins import GenerationBackend, GenerationEngine, BackendContext, Samples

Importing this package is cheap: no torch, ray, vllm or deepspeed. The types that hold tensors
(``AdvantageInputs``, ``PolicyLossInputs``, ``Rollout``) are imported on first access.
"""
from __future__ import annotations

from typing import Any

from ._markers import ENTRY_POINT_GROUP, hookimpl, hookspec
from ._version import __version__
from .config import Config, OptionRegistry
from .dispatch import dispatch
from .errors import ConfigError, DataError, PluginError, RewardError, UsageError
from .protocols import (
    BackendContext,
    Batch,
    Endpoint,
    GenerationEngine,
    Learner,
    ModelWorker,
    Objective,
    Placement,
    PlacementContext,
    RankContext,
    RoleHandle,
    Samples,
    SamplingParams,
    WeightShapes,
    WeightSync,
    on_model_workers,
    share_weights,
)
from .settings import setting
from .types import (
    AdvantageEstimator,
    Component,
    Environment,
    GenerationBackend,
    KLEstimator,
    LearnerBackend,
    PlacementStrategy,
    PolicyLoss,
    RewardFunction,
    WeightSyncMethod,
)

#: exported names whose modules import torch: loaded on first access
_LAZY = {
    "AdvantageInputs": "rlhf_plugins.algorithms.advantages",
    "PolicyLossInputs": "rlhf_plugins.algorithms.policy_losses",
    "Rollout": "rlhf_plugins.training.rollout",
    "Plan": "rlhf_plugins.config.validate",
    "build_config": "rlhf_plugins.config.loading",
    "MemoryInputs": "rlhf_plugins.models.memory",
    "ModelShape": "rlhf_plugins.models.model_shape",
    "Delegate": "rlhf_plugins.extending",
    "builtin": "rlhf_plugins.extending",
    "derive": "rlhf_plugins.extending",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlhf_plugins' has no attribute '{name}'")


__all__ = [
    "ENTRY_POINT_GROUP",
    "setting",
    "AdvantageEstimator",
    "AdvantageInputs",
    "BackendContext",
    "Batch",
    "MemoryInputs",
    "ModelShape",
    "Objective",
    "WeightShapes",
    "build_config",
    "builtin",
    "Delegate",
    "derive",
    "share_weights",
    "Component",
    "Config",
    "ConfigError",
    "DataError",
    "Endpoint",
    "GenerationBackend",
    "GenerationEngine",
    "KLEstimator",
    "Learner",
    "LearnerBackend",
    "ModelWorker",
    "OptionRegistry",
    "Placement",
    "PlacementContext",
    "PlacementStrategy",
    "Plan",
    "PluginError",
    "PolicyLoss",
    "PolicyLossInputs",
    "RankContext",
    "RewardError",
    "RewardFunction",
    "RoleHandle",
    "Rollout",
    "Samples",
    "SamplingParams",
    "UsageError",
    "WeightSync",
    "WeightSyncMethod",
    "Environment",
    "__version__",
    "dispatch",
    "hookimpl",
    "hookspec",
    "on_model_workers",
]
