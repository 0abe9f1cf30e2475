"""Builtin learner ``fsdp``: PyTorch FSDP2 (``fully_shard``) across data-parallel ranks.

Adds the ``fsdp`` config section (``--fsdp.reshard_after_forward``, ``--fsdp.offload_params``)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .._lazy import Lazy
from .._markers import hookimpl
from ..errors import ConfigError
from ..types import LearnerBackend


@dataclass
class FSDPOptions:
    #: free each layer's gathered weights after its forward (gathered again for backward): the least
    #: memory; false keeps them from forward to backward (one all-gather less per layer)
    reshard_after_forward: bool = True
    #: keep the parameter, gradient and optimizer-state shards in CPU memory (the optimizer steps there)
    offload_params: bool = False


@hookimpl
def rlhf_add_options(options: Any) -> None:
    options.add_section("fsdp", FSDPOptions)


@hookimpl
def rlhf_configure(config: Any) -> None:
    if config.learner.backend == "fsdp" and config.model.dtype == "float16":
        raise ConfigError("learner.backend fsdp trains in bfloat16 or float32 (float16 would need a gradient "
                          "scaler): use --model.dtype bfloat16")


@hookimpl
def rlhf_learner_backends() -> Iterable[LearnerBackend]:
    yield LearnerBackend(
        "fsdp",
        factory=Lazy("rlhf_plugins.learners.fsdp_learner:FSDPLearner"),
        description="PyTorch FSDP2 (fully_shard per decoder layer), mixed precision, CPU offload, torch.compile",
        multi_rank=True,
        memory=Lazy("rlhf_plugins.models.memory:fsdp_learner_memory"),
        shards_reference=True,  # the reference model over --ray.reference_workers ranks, 1/N each
        shards=lambda config: 3,  # weights, gradients and optimizer states: 1/N each
        compiles=True,
        float32_head=True,  # the root unit (embeddings, final norm, head) computes in float32
    )
