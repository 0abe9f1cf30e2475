"""Builtin learner ``torch``: plain torch AdamW in one process."""
from __future__ import annotations

from collections.abc import Iterable

from .._lazy import Lazy
from .._markers import hookimpl
from ..types import LearnerBackend


@hookimpl
def rlhf_learner_backends() -> Iterable[LearnerBackend]:
    yield LearnerBackend(
        "torch",
        factory=Lazy("rlhf_plugins.learners.torch_learner:TorchLearner"),
        description="plain torch AdamW, one process, gradient accumulation, torch.compile",
        memory=Lazy("rlhf_plugins.models.memory:torch_learner_memory"),
        live_weights=True,
        compiles=True,
        graphs=True,  # its weights stay where they are: CUDA graphs of the compiled modules can hold them
        float32_head=True,  # a float32 head is its own master (learners/master_weights.py)
        whole_parameters=True,  # its optimizer sees each parameter whole: Adafactor factors its matrices
    )
