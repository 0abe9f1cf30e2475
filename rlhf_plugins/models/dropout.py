"""``--learner.disable_dropout``: no dropout in the trained roles' forwards.

PPO and GRPO compare the policy's log-probs of a sample with the ones it was sampled with; a training
forward with dropout computes them for a randomly thinned network, so the ratios of an on-policy
update are not 1, the train/inference gap (``mismatch/abs_log_ratio``) measures the dropout's noise,
and the gradient is that of another policy. Most decoder configs set their dropout to 0; some keep it
(Seed-OSS's ``attention_dropout`` and ``residual_dropout`` are 0.1, OPT's and GPT-2's ``dropout`` too).

Models apply dropout two ways: ``torch.nn.Dropout`` modules, and a probability a module keeps as an
attribute and hands to ``nn.functional.dropout`` or to the attention function in its forward
(transformers' ``self.attention_dropout``). Both are set to 0 here, on the loaded model, not in its
config, so a saved model keeps its config as it was. A LoRA adapter's dropout (PEFT's ``lora_dropout``
modules, set by ``--lora.dropout``) is the user's own choice and stays.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("rlhf_plugins")

#: the roles whose model is trained (their training forwards are the ones in train mode)
ROLES = ("actor", "critic")


def disable_dropout(model: torch.nn.Module, role: str) -> int:
    """Set every dropout probability of ``model`` outside LoRA adapters to 0; returns how many were not 0
    (said in one line when some were)."""
    changed = 0
    for name, module in model.named_modules():
        if "lora_dropout" in name:
            continue
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p:
            module.p = 0.0
            changed += 1
        for key, value in list(vars(module).items()):
            if "dropout" in key and isinstance(value, float) and value:
                setattr(module, key, 0.0)
                changed += 1
    if changed:
        logger.info("dropout off in the %s's training forward (%d probabilities were set; "
                    "--learner.disable_dropout false keeps them)", role, changed)
    return changed
