"""The learners' optimizer: ``learner.optimizer`` with its settings, over param groups that leave biases
and normalisation weights undecayed (:mod:`.decay`)."""
from __future__ import annotations

from typing import Any

import torch

from .decay import decay_groups, undecayed

__all__ = ["make_optimizer", "undecayed"]


def make_optimizer(params: list[Any], cfg: Any, lr: float, names: list[str] | None = None,
                   skip_decay: set[str] | None = None) -> torch.optim.Optimizer:
    """``learner.optimizer`` with its settings (betas, eps, momentum, weight decay) over ``params`` (named
    ``names``; those in ``skip_decay`` not decayed). Adam(W) runs torch's fused implementation where every
    parameter is a plain CPU or CUDA tensor (not an FSDP2 shard): one pass over each tensor and no
    temporaries, where the per-tensor one allocates float32 temporaries the size of the largest parameter
    (0.8 GB more at the peak for a 0.5B model's embedding, measured)."""
    skip = skip_decay or set()
    if cfg.optimizer == "muon":  # ``names``: the parameters' names, which choose Muon or AdamW
        from .muon import MuonWithAdamW

        return MuonWithAdamW(list(zip(names or [""] * len(params), params)), cfg, lr, skip)
    groups = decay_groups(params, cfg, names, skip)
    if cfg.optimizer == "adafactor":  # as transformers' Trainer makes it for optim="adafactor" (TRL's)
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    fused = bool(params) and all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda")
                                 and p.is_floating_point() for p in params)
    return cls(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
               **({"fused": True} if fused else {}))
