"""Which parameters weight decay reaches: not biases and normalisation weights, as transformers' Trainer
(TRL) and OpenRLHF both have it -- decaying a norm's gain towards 0 shrinks its layer's output rather than
regularising it. ``--learner.weight_decay_all`` decays every trainable parameter instead."""
from __future__ import annotations

import re
from typing import Any

import torch

#: parameter names of biases and normalisation weights (transformers' Trainer's patterns, lower case)
UNDECAYED_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
#: class names of normalisation layers, lower case (not Baichuan's NormHead, an output head)
NORM_LAYERS = re.compile(r"norm$|layernorm|rmsnorm|groupnorm|batchnorm")


def undecayed(model: torch.nn.Module) -> set[str]:
    """Names (as ``model.named_parameters()`` gives them) of the parameters weight decay leaves alone: those
    of a module whose class is a normalisation layer (LayerNorm, RMSNorm, Qwen2RMSNorm, ...) and those whose
    name says bias or norm."""
    names = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        norm = NORM_LAYERS.search(type(module).__name__.lower()) is not None
        for name, _ in module.named_parameters(prefix=prefix, recurse=False, remove_duplicate=False):
            if norm or UNDECAYED_NAMES.search(name.lower()):
                names.add(name)
    return names


def decayed_everything(folder: Any) -> Exception:
    """The one line for a checkpoint whose optimizer has one param group where this run makes two: written
    before biases and norms were left undecayed, it resumes with ``--learner.weight_decay_all true``."""
    from ..errors import UsageError

    return UsageError(f"{folder}'s optimizer decays every parameter (written before biases and norms were left "
                      "undecayed); resume it with --learner.weight_decay_all true")


def decay_groups(params: list[Any], cfg: Any, names: list[str] | None, skip: set[str]) -> list[Any]:
    """``params`` as param groups: the decayed ones, then those named in ``skip`` at weight decay 0 -- or
    ``params`` themselves (one group) with no decay to leave out."""
    if not cfg.weight_decay or cfg.weight_decay_all or not names or not skip:
        return params
    decayed = [p for name, p in zip(names, params) if name not in skip]
    kept = [p for name, p in zip(names, params) if name in skip]
    return [group for group in ({"params": decayed}, {"params": kept, "weight_decay": 0.0}) if group["params"]]
