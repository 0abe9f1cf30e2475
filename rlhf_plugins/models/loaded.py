"""What a loaded model gets whichever plugin loaded it (``RLHFPluginManager.load_model``): the options
that change a model in place, for the roles they concern."""
from __future__ import annotations

from typing import Any

import torch


def finish_loading(model: torch.nn.Module, role: str, config: Any) -> torch.nn.Module:
    """``model`` as loaded for ``role``, with ``--model.fp32_lm_head`` (the roles computing the policy's
    log-probs), ``--learner.disable_dropout`` (the trained roles) and a contiguous head input applied."""
    from .dropout import ROLES as TRAINED
    from .dropout import disable_dropout
    from .float32_head import ROLES, float32_head
    from .logits import contiguous_head_input

    if config.model.fp32_lm_head and role in ROLES:
        float32_head(model)
    if config.learner.disable_dropout and role in TRAINED:
        disable_dropout(model, role)
    contiguous_head_input(model)
    return model
