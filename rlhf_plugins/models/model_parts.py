"""The parts of a causal language model the learner reaches into -- its config, its output head, its
input embedding -- seen through a DeepSpeed engine (``.module``); a PEFT wrapper answers for its base
model."""
from __future__ import annotations

from typing import Any

import torch


def unwrapped(model: Any) -> Any:
    """The model itself, or the module a DeepSpeed engine wraps (``None`` when neither has heads).

    The engine passes attribute reads through to its module, so it seems to have the model's heads, but
    not all of them: its ``config`` is DeepSpeed's own. Its module is asked first."""
    inner = getattr(model, "module", None)
    if isinstance(inner, torch.nn.Module) and hasattr(inner, "get_output_embeddings"):
        return inner
    return model if hasattr(model, "get_output_embeddings") else None


def model_config(model: Any) -> Any:
    """The transformers config of ``model``, or of the model a DeepSpeed engine or PEFT wrapper holds
    (``None`` when neither has one)."""
    for candidate in (getattr(model, "module", None), model):
        config = getattr(candidate, "config", None)
        if hasattr(config, "get_text_config"):
            return config
    return None


def output_embeddings(model: Any) -> torch.nn.Module | None:
    """The model's output head module, if it has one."""
    get = getattr(unwrapped(model), "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None
