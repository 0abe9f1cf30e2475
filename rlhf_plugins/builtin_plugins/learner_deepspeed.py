"""Builtin learner ``deepspeed``: ZeRO 0-3 across data-parallel ranks.

Adds the ``deepspeed`` config section (``--deepspeed.zero_stage 3``, offload, sleep)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .._lazy import Lazy
from .._markers import hookimpl
from ..errors import ConfigError
from ..settings import setting
from ..types import LearnerBackend


@dataclass
class DeepSpeedOptions:
    #: ZeRO stage 0-3
    zero_stage: int = setting(2, ge=0, le=3)
    #: CPU offload of optimizer states (ZeRO 1-3)
    offload_optimizer: bool = False
    #: CPU offload of parameters (ZeRO-3 only)
    offload_params: bool = False
    #: offload the learner's states while the engine generates (GPU, ZeRO-3)
    sleep: bool = False


@hookimpl
def rlhf_add_options(options: Any) -> None:
    options.add_section("deepspeed", DeepSpeedOptions)


@hookimpl
def rlhf_configure(config: Any) -> None:
    o = config.section("deepspeed")
    if o.offload_params and o.zero_stage != 3:
        raise ConfigError("deepspeed.offload_params needs deepspeed.zero_stage 3")
    if o.offload_optimizer and o.zero_stage == 0:
        raise ConfigError("deepspeed.offload_optimizer needs deepspeed.zero_stage 1, 2 or 3")


@hookimpl
def rlhf_learner_backends() -> Iterable[LearnerBackend]:
    yield LearnerBackend(
        "deepspeed",
        factory=Lazy("rlhf_plugins.learners.deepspeed_learner:DeepSpeedLearner"),
        description="DeepSpeed ZeRO 0-3, optimizer/parameter offload, bf16, gradient checkpointing",
        requires=("deepspeed",),
        extra="deepspeed",
        multi_rank=True,
        memory=Lazy("rlhf_plugins.models.memory:deepspeed_learner_memory"),
        shards=zero_stage,
    )


def zero_stage(config: Any) -> int:
    """How far ZeRO shards the learner's states: its stage."""
    return config.section("deepspeed").zero_stage
