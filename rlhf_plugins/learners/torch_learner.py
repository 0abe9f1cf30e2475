"""The plain torch learner: one process, AdamW, gradient accumulation.

One rollout is cut into mini batches (one optimizer step each) and those into
micro batches (one forward/backward each); micro-batch losses are weighted so
the accumulated gradient equals that of the whole mini batch.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterator

import torch

from ..modeling import group_permutation, policy_forward, split_batch, value_forward


class TorchLearner:
    def __init__(self, load_model: Callable[[], torch.nn.Module], config: Any, role: str = "actor") -> None:
        self.model = model = load_model()
        if config.learner.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.role = role
        self.cfg = config.learner
        self.temperature = config.generation.temperature
        critic = role == "critic"
        self.forward: Callable[..., dict[str, torch.Tensor]] = value_forward if critic else policy_forward
        self.output = "values" if critic else "logprobs"
        lr = config.critic.lr if critic else self.cfg.lr
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=self.cfg.weight_decay)
        self.updates = 0
        self.generator = torch.Generator().manual_seed(config.train.seed)

    @torch.inference_mode()
    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's per-token output without gradient: log-probs, or values for a critic."""
        return self.forward(self.model, batch, self.temperature)[self.output]

    def train(self, batch: dict[str, torch.Tensor], objective: Any) -> dict[str, float]:
        self.model.train()
        n = batch["sequences"].shape[0]
        mini = self.cfg.mini_batch_size or n
        micro = self.cfg.micro_batch_size or mini
        totals: dict[str, float] = defaultdict(float)
        count = 0
        for _ in range(self.cfg.epochs):
            order = None
            if self.cfg.epochs > 1 or mini < n:
                order = group_permutation(n, int(batch.get("group_size", 1)), self.generator)
            shuffled = batch if order is None else {k: v[order] if torch.is_tensor(v) else v for k, v in batch.items()}
            for mini_batch in split_batch(shuffled, mini):
                for key, value in self._update(mini_batch, micro, objective).items():
                    totals[key] += value
                count += 1
        self.model.eval()
        return {k: v / count for k, v in totals.items()}

    def _update(self, mini_batch: dict[str, torch.Tensor], micro: int, objective: Any) -> dict[str, float]:
        metrics: dict[str, float] = defaultdict(float)
        mini_mask = mini_batch["action_mask"]
        for part in split_batch(mini_batch, micro):
            outputs = self.forward(self.model, part, self.temperature, with_entropy=objective.needs_entropy)
            loss, m = objective(outputs, part)
            w = objective.weight(part["action_mask"], mini_mask) * float(part.get("dp_weight", 1.0))
            (loss * w).backward()
            for key, value in m.items():
                metrics[key] += float(value) * w
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        metrics["grad_norm"] = float(grad_norm)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def raw_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's own tensors and names (PEFT names under LoRA)."""
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the generation engine loads (LoRA merged in under base names)."""
        from ..integrations.peft import export_weights

        return export_weights(self.model, self.raw_named_weights())

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
