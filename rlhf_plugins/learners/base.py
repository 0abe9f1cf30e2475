"""What every learner shares: the role's forward, and the update loop over one rollout.

A rollout is cut into mini batches (one optimizer step each) and those into micro
batches (one forward/backward each); micro-batch losses are weighted so the
accumulated gradient equals that of the whole mini batch (and, across
data-parallel ranks, that of the whole rollout). Subclasses say how to run
backward and the optimizer step.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch

from ..models.device import to_device
from ..models.forward import group_permutation, policy_forward, split_batch, value_forward
from ..models.packing import in_token_budget, lay_out, real_tokens, sharing_group, token_budget_split
from ..models.router_loss import coefficient, load_balancing_loss, router_logits


def weighted_metrics(done: list[tuple[dict[str, Any], float]]) -> dict[str, float]:
    """The sum over micro batches of each metric times its micro batch's weight, from ``(metrics,
    weight)`` pairs; the tensors among the values are read back to the host in one transfer."""
    tensors = [v.detach().reshape(()).float() for m, _ in done for v in m.values() if torch.is_tensor(v)]
    values = iter(torch.stack([t.to(tensors[0].device) for t in tensors]).tolist() if tensors else [])
    totals: dict[str, float] = defaultdict(float)
    for m, w in done:
        for key, value in m.items():
            totals[key] += (next(values) if torch.is_tensor(value) else float(value)) * w
    return totals


def updates_per_run(config: Any) -> int:
    """Optimizer updates of the whole run (the schedule's length): epochs x mini batches per rollout."""
    return max(1, config.train.steps * config.updates_per_step())


def lr_factor(update: int, cfg: Any, total: int) -> float:
    """The learning rate's multiplier at ``update``: linear warm-up, then constant / linear / cosine
    decay to ``min_lr_ratio`` at the last update."""
    warmup = cfg.warmup_steps or int(round(cfg.warmup_ratio * total))
    if update < warmup:
        return (update + 1) / (warmup + 1)
    if cfg.lr_scheduler == "constant":
        return 1.0
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    shape = 1.0 - progress if cfg.lr_scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def make_scheduler(optimizer: torch.optim.Optimizer, config: Any, cfg: Any) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning-rate schedule of a learner whose settings are ``cfg`` (``config.learner_of(role)``)."""
    total = updates_per_run(config)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: lr_factor(update, cfg, total))


class Learner:
    world_size = 1
    #: where the learner computes; batches are moved here and results handed back on the CPU
    device = torch.device("cpu")
    #: forwards run under torch.autocast in this dtype (mixed precision over float32 weights), or as they are
    autocast_dtype: torch.dtype | None = None

    def _compute(self) -> Any:
        """The context forwards run in: autocast to ``autocast_dtype`` on the learner's device, or none."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _init_learner(self, config: Any, role: str, seed_offset: int = 0) -> None:
        """Shared set-up: the role's forward (log-probs, or values for a critic) and learning rate."""
        self.role = role
        self.cfg = config.learner_of(role)
        self.temperature = config.generation.temperature
        critic = role == "critic"
        self.forward: Callable[..., dict[str, torch.Tensor]] = (
            value_forward if critic else partial(policy_forward, logits_memory_mb=self.cfg.logits_memory_mb))
        self.output = "values" if critic else "logprobs"
        self.lr = config.critic.lr if critic else self.cfg.lr
        self.updates = 0
        self.generator = torch.Generator().manual_seed(config.train.seed + seed_offset)
        #: --learner.ema: the moving average of the actor's weights (:mod:`.ema`), started by :meth:`_keep_average`
        self.average: Any = None

    def _keep_average(self, sources: list[torch.Tensor] | None = None) -> None:
        """--learner.ema (the actor): start averaging this rank's parts of the trainable weights, updated
        from ``sources`` (their float32 masters, where the learner keeps them) or from the parts."""
        if self.cfg.ema and self.role == "actor":
            from .ema import WeightAverage, local_part

            parts = [local_part(p) for p in self.model.parameters() if p.requires_grad]
            self.average = WeightAverage(parts, self.cfg.ema_beta, sources)

    # --- to provide -----------------------------------------------------------------
    def _module(self) -> Any:
        """What to call for a forward pass (the model, or the DeepSpeed engine)."""
        raise NotImplementedError

    def _packed_model(self, module: Any) -> Any:
        """The model a packed micro batch's forward reaches (:mod:`rlhf_plugins.models.packing` asks it
        how to lay out the rows): ``module`` itself here; the FSDP learner's root wraps its model."""
        return module

    def _backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def _step(self) -> float:
        """Clip, apply and clear the accumulated gradients; return the gradient norm."""
        raise NotImplementedError

    def _lr(self) -> float:
        raise NotImplementedError

    #: the no-gradient mode of ``logprobs`` (FSDP2's gathers cannot run under inference mode)
    no_grad: Callable[[], Any] = staticmethod(torch.inference_mode)

    # --- shared -----------------------------------------------------------------------
    def logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        """The model's per-token output without gradient: log-probs, or values for a critic."""
        module = self._module()
        module.eval()
        batch = to_device(batch, self.device)
        with self.no_grad(), self._compute():
            out = in_token_budget(lambda part: self.forward(module, part, self.temperature)[self.output], batch,
                                  self.cfg.max_tokens_per_micro_batch, self._packed_model(module))
        return out.float().cpu()

    def train(self, batch: dict[str, Any], objective: Any) -> dict[str, float]:
        module = self._module()
        module.train()
        batch = to_device(batch, self.device)
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
        """Forward and backward of each micro batch, then one optimizer step. No tensor's value is read
        on the host between the first forward and the last backward: each micro batch's weight is read
        before, its metrics after (on a GPU such a read makes the host wait until every queued kernel has
        run, and the GPU then idles while the host issues the next ones)."""
        mini_mask = mini_batch["action_mask"]
        budget = self.cfg.max_tokens_per_micro_batch
        model = self._packed_model(module)
        router = coefficient(model, self.cfg.router_aux_loss_coef) if self.role == "actor" else 0.0
        if router:  # a mixture of experts' load-balancing loss runs every sample whole (models/router_loss.py)
            mini_batch = dict(mini_batch, group_size=1)
        parts = (token_budget_split(mini_batch, budget, sharing_group(model, mini_batch)) if budget
                 else split_batch(mini_batch, micro))
        lay_out(model, parts)  # packed rows, before the first forward
        weights = [objective.weight(part["action_mask"], mini_mask) * float(part.get("dp_weight", 1.0))
                   for part in parts]
        done = []
        for part, w in zip(parts, weights):
            with self._compute(), router_logits(model) if router else nullcontext([]) as routed:
                outputs = self.forward(module, part, self.temperature, with_entropy=objective.needs_entropy)
            loss, m = objective(outputs, part)
            if routed:  # one forward of the micro batch, its samples whole
                m["loss/router_aux"] = aux = load_balancing_loss(model, routed[0], real_tokens(part))
                loss = loss + router * aux
            self._backward(loss * w)
            done.append((m, w))
        metrics = weighted_metrics(done)
        own = "critic/" if self.role == "critic" else ""  # beside the actor's in a step's metrics
        metrics[f"{own}grad_norm"] = self._step()
        if self.average is not None:
            self.average.update()
        metrics[f"{own}lr"] = self._lr()
        self.updates += 1
        return metrics

    def raw_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's own tensors and names (PEFT names under LoRA); every rank iterates."""
        raise NotImplementedError

    def trained_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors the optimizer trains (under LoRA: the adapter's, PEFT names); every rank iterates.
        Sharded learners gather these alone."""
        trained = {name for name, param in self.model.named_parameters() if param.requires_grad}
        return ((name, tensor) for name, tensor in self.raw_named_weights() if name in trained)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the generation engine loads (LoRA merged in under base names)."""
        from ..models.lora import export_weights

        return export_weights(self.model, self.raw_named_weights())

    def adapter_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The LoRA adapter alone (PEFT's saved names) and its config, for adapter sync."""
        from ..errors import UsageError
        from ..models.lora import adapter_weights, config_dict, lora_config_of

        cfg = lora_config_of(self.model)
        if cfg is None:
            raise UsageError("adapter sync needs LoRA on the actor: set --lora.rank (or --lora.config)")
        trained = ((name, tensor.cpu()) for name, tensor in self.trained_named_weights())
        return adapter_weights(self.model, trained), config_dict(cfg)

    def _save_progress(self, file: Any) -> None:
        """Update count and random state of this rank (the generator orders mini batches; the
        process RNG drives dropout, the GPU's RNG dropout on the GPU)."""
        state = {"updates": self.updates, "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        if self.average is not None:
            state["average"] = self.average.state()
        torch.save(state, file)

    def _load_progress(self, file: Any) -> None:
        state = torch.load(file, weights_only=True)
        self.updates = int(state["updates"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        if self.average is not None:
            self.average.load(state["average"])

    def save_average(self, path: str) -> None:
        """The final model from the moving average of the weights (--learner.ema), else from the weights."""
        if self.average is None and self.cfg.ema and self.role == "actor":
            from ..errors import PluginError

            raise PluginError(f"{type(self).__name__} keeps no average of the weights for --learner.ema: call "
                              "self._keep_average() once its optimizer exists")
        if self.average is None:
            return self.save(path)
        self.average.swapped_in(lambda: self.save(path))

    def shutdown(self) -> None:
        pass
