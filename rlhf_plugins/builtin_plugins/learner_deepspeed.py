"""Builtin learner ``deepspeed``: ZeRO 1-3 across data-parallel ranks."""
from __future__ import annotations

from typing import Any, Iterable

from .._lazy import Lazy
from .._markers import hookimpl
from ..errors import ConfigError
from ..types import LearnerBackend


@hookimpl
def rlhf_configure(config: Any) -> None:
    if config.learner.backend != "deepspeed":
        return
    l = config.learner
    if l.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"learner.zero_stage must be 0, 1, 2 or 3; got {l.zero_stage}")
    if l.offload_params and l.zero_stage != 3:
        raise ConfigError("learner.offload_params needs learner.zero_stage 3")
    if l.offload_optimizer and l.zero_stage == 0:
        raise ConfigError("learner.offload_optimizer needs learner.zero_stage 1, 2 or 3")


@hookimpl
def rlhf_learner_backends() -> Iterable[LearnerBackend]:
    yield LearnerBackend(
        "deepspeed",
        factory=Lazy("rlhf_plugins.learners.deepspeed_learner:DeepSpeedLearner"),
        description="DeepSpeed ZeRO 1-3, optimizer/parameter offload, bf16, gradient checkpointing",
        requires=("deepspeed",),
        extra="deepspeed",
    )
