"""The plain torch learner: one process, AdamW, gradient accumulation (see ``base``)."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from .base import Learner


class TorchLearner(Learner):
    def __init__(self, load_model: Callable[[], torch.nn.Module], config: Any, role: str = "actor") -> None:
        self._init_learner(config, role)
        self.model = model = load_model()
        if self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.cfg.weight_decay)

    def _module(self) -> Any:
        return self.model

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _step(self) -> float:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def _lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def raw_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's own tensors and names (PEFT names under LoRA)."""
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def save(self, path: str) -> None:
        self.model.save_pretrained(path)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = state["updates"]
        self.generator.set_state(state["generator"])
