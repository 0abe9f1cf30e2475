"""The parts of a causal language model the learner reaches into -- its output head, its input
embedding -- seen through a DeepSpeed engine (``.module``); a PEFT wrapper answers for its base model."""
from __future__ import annotations

from typing import Any

import torch


def unwrapped(model: Any) -> Any:
    """The model itself, or the module a DeepSpeed engine wraps (``None`` when neither has heads)."""
    return model if hasattr(model, "get_output_embeddings") else getattr(model, "module", None)


def output_embeddings(model: Any) -> torch.nn.Module | None:
    """The model's output head module, if it has one."""
    get = getattr(unwrapped(model), "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None
