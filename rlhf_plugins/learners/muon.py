"""``--learner.optimizer muon``: Muon (momentum orthogonalised by Newton-Schulz iterations) for the
hidden weight matrices, AdamW for everything else -- the split of Muon's authors, DeepSpeed's and
OpenRLHF's: a tensor of two or more dimensions whose name holds neither ``embed`` nor ``lm_head``.
Muon steps at ``--learner.muon_lr``, AdamW at ``--learner.lr``; the schedule scales both.

The torch learner runs torch's own ``torch.optim.Muon`` (torch 2.9+) on whole matrices; the
DeepSpeed learner DeepSpeed's (ZeRO gathers each matrix to orthogonalise it). The FSDP2 learner runs
``torch.optim.Muon`` on its row shards (DTensors): the momentum is kept shard by shard, and each
Newton-Schulz step's norm and matrix products are DTensor operations, which gather across the ranks
what each needs -- the whole-matrix orthogonalisation with each rank computing its rows, equal to the
torch learner's up to the order of bf16 sums (``tests/test_fsdp.py``)."""
from __future__ import annotations

from typing import Any

import torch

from ..models.model_shape import uses_muon
from .decay import decay_groups


def check_torch_muon() -> None:
    """One line when this torch predates ``torch.optim.Muon``."""
    if not hasattr(torch.optim, "Muon"):
        from ..errors import ConfigError

        raise ConfigError(f"learner.optimizer muon needs torch.optim.Muon (torch 2.9 or newer); this is torch "
                          f"{torch.__version__}: upgrade torch or use --learner.backend deepspeed")


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer (one set of param groups and state, for the schedule and checkpoints) made of
    ``torch.optim.Muon`` over the hidden matrices and ``torch.optim.AdamW`` over the rest; the two
    step the groups they were built with, which stay shared with this optimizer."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], cfg: Any, lr: float,
                 skip_decay: set[str] | None = None) -> None:
        hidden = [p for name, p in named if uses_muon(name, p)]
        rest = [(name, p) for name, p in named if not uses_muon(name, p)]
        self.parts: list[torch.optim.Optimizer] = []  # AdamW first: the logged lr is learner.lr's
        if rest:  # biases and norms (skip_decay) undecayed, as everywhere
            groups = decay_groups([p for _, p in rest], cfg, [name for name, _ in rest], skip_decay or set())
            self.parts.append(torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                                weight_decay=cfg.weight_decay))
        if hidden:
            self.parts.append(torch.optim.Muon(hidden, lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                                               momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                                               ns_steps=cfg.muon_ns_steps))
        super().__init__([group for part in self.parts for group in part.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Point each part at this optimizer's groups and state (after a load replaced them)."""
        start = 0
        for part in self.parts:
            count = len(part.param_groups)
            part.param_groups = self.param_groups[start:start + count]
            part.state = self.state
            start += count

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()


def deepspeed_muon(cfg: Any, lr: float) -> dict[str, Any]:
    """DeepSpeed's optimizer section for Muon (its MuonWithAuxAdam: Muon at muon_lr, Adam at lr). The Adam half
    is torch's AdamW (``torch_adam``), as in every other DeepSpeed run here: DeepSpeed's default, its FusedAdam,
    is a C++ build on the CPU accelerator (3.5 minutes on two cores, measured) before the first step."""
    return {"type": "muon", "params": {"lr": lr, "muon_lr": cfg.muon_lr, "adam_lr": lr, "momentum": cfg.muon_momentum,
                                       "betas": list(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay,
                                       "torch_adam": True}}
