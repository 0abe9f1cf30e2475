"""The plain torch learner: one process, AdamW (or Adam, SGD) with a learning-rate schedule,
gradient accumulation (see ``base``).

With ``--model.dtype bfloat16`` (or float16) it trains in mixed precision: the model's weights in 16
bits with float32 master copies, gradients and optimizer states (:mod:`.master_weights`, as DeepSpeed
trains), or with ``--learner.master_weights false`` float32 weights with forwards under
``torch.autocast`` in the 16-bit dtype, as transformers' Trainer does with ``bf16=True``. float16 adds
a gradient scaler. The reference model and the generation engine keep the 16-bit weights.
``--learner.compile`` compiles the decoder's norms and MLPs (:mod:`rlhf_plugins.models.compiled`)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..models.compiled import keep_grads_allocated, replays_graphs
from ..models.float32_head import weights_dtype
from ..models.hf_names import enable_checkpointing
from ..protocols import BackendContext
from .base import Learner, make_scheduler
from .decay import decayed_everything
from .optimizer import make_optimizer, undecayed


class TorchLearner(Learner):
    def __init__(self, ctx: BackendContext) -> None:
        self._init_learner(ctx.config, ctx.role)
        from ..models.device import role_device

        self.device = role_device()
        model = ctx.load_model()
        dtype = weights_dtype(model)  # a float32 head (--model.fp32_lm_head) aside
        if dtype != torch.float32 and not self.cfg.master_weights:  # float32 weights, forwards autocast
            self.autocast_dtype = dtype
            model = model.float()
        self.model = model = model.to(self.device)
        self.scaler = torch.amp.GradScaler(self.device.type) if dtype is torch.float16 else None
        if self.cfg.gradient_checkpointing:
            enable_checkpointing(model)
        if self.cfg.compile:  # the decoder's norms and MLPs as fused kernels (models/compiled.py)
            from ..models.compiled import compile_blocks

            compile_blocks(model, self.device, self.role, self.cfg.compile_scope, self.cfg.compile_mode)
        params = [p for p in model.parameters() if p.requires_grad]
        self.masters = None
        if dtype != torch.float32 and self.autocast_dtype is None:  # 16-bit weights, float32 masters
            from .master_weights import BUCKET_BYTES, MasterWeights

            # with CUDA graphs each 16-bit gradient leaves the graphs' pool as it completes
            self.masters = MasterWeights(model, 0 if replays_graphs(self.cfg) else BUCKET_BYTES)
            params = list(self.masters.params)
        # with CUDA graphs, gradients accumulate in tensors of their own, not in the graphs' pool (a float32
        # learner's; a 16-bit one's float32 parameters: LoRA's adapters, a float32 head; masters have theirs)
        self.grads_kept = replays_graphs(self.cfg)
        if self.grads_kept:
            keep_grads_allocated(params)
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.optimizer = make_optimizer(params, self.cfg, self.lr, names, undecayed(model))
        self.scheduler = make_scheduler(self.optimizer, ctx.config, self.cfg)
        self._keep_average(None if self.masters is None else list(self.masters.params))

    def _module(self) -> Any:
        return self.model

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _step(self) -> float:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm or float("inf"))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.masters is not None:
            self.masters.write_back()
        self.scheduler.step()
        # the masters' float32 gradients stay allocated (each parameter's main_grad points at its own)
        self.optimizer.zero_grad(set_to_none=self.masters is None and not self.grads_kept)
        return float(grad_norm)

    def _lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def raw_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's own tensors and names (PEFT names under LoRA), a tied tensor once."""
        from ..models.weights import tied_aliases

        aliases = tied_aliases(self.model)
        for name, tensor in self.model.state_dict().items():
            if name not in aliases:
                yield name, tensor.detach()

    def live_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """The parameters the optimizer updates in place (None under LoRA: the engine needs the
        adapters merged into the base weights, which are not these tensors)."""
        from ..models.lora import lora_config_of

        if lora_config_of(self.model) is not None or self.autocast_dtype is not None:
            return None  # 16-bit: the engine's are not these either
        return [(name, p.detach()) for name, p in self.model.named_parameters()]

    def save(self, path: str) -> None:
        from ..models.folder import save_pretrained

        save_pretrained(self.model, path)

    def save_checkpoint(self, path: str) -> None:
        """Weights as safetensors shards (every tensor of the model, LoRA included; tied tensors once;
        16-bit runs' trainable tensors as their float32 masters),
        the optimizer's state and the learner's counters and random state."""
        from huggingface_hub import save_torch_state_dict

        from ..models.folder import SHARD_BYTES

        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        state = self.model.state_dict() if self.masters is None else self.masters.state_dict(self.model)
        save_torch_state_dict(state, folder, max_shard_size=SHARD_BYTES)
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                   folder / "optimizer.pt")
        self._save_progress(folder / "learner.pt")

    def load_checkpoint(self, path: str) -> None:
        from ..models.folder import load_shards

        folder = Path(path)
        load_shards(self.model, folder)
        if self.masters is not None:
            self.masters.load(self.model, folder)
        state = torch.load(folder / "optimizer.pt", weights_only=True)
        if len(state["optimizer"]["param_groups"]) < len(self.optimizer.param_groups) and self.cfg.weight_decay:
            raise decayed_everything(folder)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._load_progress(folder / "learner.pt")
