"""What every learner shares: the role's forward, and the update loop over one rollout.

A rollout is cut into mini batches (one optimizer step each) and those into micro
batches (one forward/backward each); micro-batch losses are weighted so the
accumulated gradient equals that of the whole mini batch (and, across
data-parallel ranks, that of the whole rollout). Subclasses say how to run
backward and the optimizer step.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterator

import torch

from ..modeling import group_permutation, policy_forward, split_batch, value_forward


class Learner:
    world_size = 1

    def _init_learner(self, config: Any, role: str, seed_offset: int = 0) -> None:
        self.role = role
        self.cfg = config.learner
        self.temperature = config.generation.temperature
        critic = role == "critic"
        self.forward: Callable[..., dict[str, torch.Tensor]] = value_forward if critic else policy_forward
        self.output = "values" if critic else "logprobs"
        self.lr = config.critic.lr if critic else self.cfg.lr
        self.updates = 0
        self.generator = torch.Generator().manual_seed(config.train.seed + seed_offset)

    # --- to provide -----------------------------------------------------------------
    def _module(self) -> Any:
        """What to call for a forward pass (the model, or the DeepSpeed engine)."""
        raise NotImplementedError

    def _backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def _step(self) -> float:
        """Clip, apply and clear the accumulated gradients; return the gradient norm."""
        raise NotImplementedError

    def _lr(self) -> float:
        raise NotImplementedError

    # --- shared -----------------------------------------------------------------------
    @torch.inference_mode()
    def logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        """The model's per-token output without gradient: log-probs, or values for a critic."""
        module = self._module()
        module.eval()
        return self.forward(module, batch, self.temperature)[self.output]

    def train(self, batch: dict[str, Any], objective: Any) -> dict[str, float]:
        module = self._module()
        module.train()
        n = batch["sequences"].shape[0]
        mini = max(1, (self.cfg.mini_batch_size or n * self.world_size) // self.world_size)
        micro = self.cfg.micro_batch_size or mini
        totals: dict[str, float] = defaultdict(float)
        count = 0
        for _ in range(self.cfg.epochs):
            order = None
            if self.cfg.epochs > 1 or mini < n:
                order = group_permutation(n, int(batch.get("group_size", 1)), self.generator)
            shuffled = batch if order is None else {k: v[order] if torch.is_tensor(v) else v for k, v in batch.items()}
            for mini_batch in split_batch(shuffled, mini):
                for key, value in self._update(module, mini_batch, micro, objective).items():
                    totals[key] += value
                count += 1
        module.eval()
        return {k: v / count for k, v in totals.items()}

    def _update(self, module: Any, mini_batch: dict[str, Any], micro: int, objective: Any) -> dict[str, float]:
        metrics: dict[str, float] = defaultdict(float)
        mini_mask = mini_batch["action_mask"]
        for part in split_batch(mini_batch, micro):
            outputs = self.forward(module, part, self.temperature, with_entropy=objective.needs_entropy)
            loss, m = objective(outputs, part)
            w = objective.weight(part["action_mask"], mini_mask) * float(part.get("dp_weight", 1.0))
            self._backward(loss * w)
            for key, value in m.items():
                metrics[key] += float(value) * w
        metrics["grad_norm"] = self._step()
        metrics["lr"] = self._lr()
        self.updates += 1
        return metrics

    def raw_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the generation engine loads (LoRA merged in under base names)."""
        from ..integrations.peft import export_weights

        return export_weights(self.model, self.raw_named_weights())
