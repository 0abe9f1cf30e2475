"""The FSDP2 learner: PyTorch's own sharded data parallelism (``torch.distributed.fsdp.fully_shard``),
what verl, torchtitan and TRL-through-accelerate users train with.

One instance per data-parallel rank (a Ray actor of the role group, NCCL on GPUs, gloo on CPUs), or
a single process under local placement; built for the ``reference`` role, the frozen reference model
sharded the same way (its own dtype, no optimizer). Each decoder layer is its own FSDP unit and the root holds
the rest (embeddings, final norm, head): a rank keeps 1/N of the float32 weights, gradients and
optimizer states, and gathers one layer at a time for its forward and backward (the next one
prefetched). 16-bit runs keep float32 shards and compute in the 16-bit dtype (FSDP2's mixed
precision policy; gradients reduced in float32). Gradient accumulation and the loss weights are
the shared loop's (:mod:`.base`); FSDP2 averages gradients over ranks as DeepSpeed does.

Weights for sync and export are gathered one tensor at a time (``DTensor.full_tensor``, collective);
checkpoints are ``torch.distributed.checkpoint`` folders in which every rank writes its own shards.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..models.compiled import decoder_layers
from ..models.empty_init import Source, empty_weights, load_shards, source_of
from ..models.float32_head import weights_dtype
from ..models.hf_names import enable_checkpointing
from ..protocols import BackendContext
from .base import Learner, make_scheduler
from .decay import decayed_everything
from .optimizer import make_optimizer, undecayed


class LearnerForward(torch.nn.Module):
    """The learner's whole forward -- the model, then the output head over chunks of tokens
    (:mod:`rlhf_plugins.models.logits`) -- as one module, the FSDP root: the root's tensors
    (embeddings, final norm, head) stay gathered through all of it, and through the chunks'
    recomputation in backward, instead of being resharded when the model's own forward returns."""

    def __init__(self, model: torch.nn.Module, forward: Any) -> None:
        super().__init__()
        self.model, self.forward_fn = model, forward

    def forward(self, batch: dict[str, Any], temperature: float, **kwargs: Any) -> dict[str, torch.Tensor]:
        # FSDP2 hooks the root's outputs for the backward's all-gather: an in-place op on a view among them (a
        # critic's values[..., 0], a chunked head's log-probs) would drop that hook without a word. [B, T] copies.
        out = self.forward_fn(self.model, batch, temperature, **kwargs)
        return {k: v.clone() if torch.is_tensor(v) and v._base is not None else v for k, v in out.items()}


def _call(module: Any, batch: dict[str, Any], temperature: float, **kwargs: Any) -> dict[str, torch.Tensor]:
    return module(batch, temperature, **kwargs)


def _load(ctx: BackendContext) -> tuple[torch.nn.Module, Source | None]:
    """The role's model, empty where the loader can make it so (then where its shards are read
    from); whole under a LoRA whose initialisation reads the base weights."""
    from contextlib import nullcontext

    from ..builtin_plugins.lora import reads_base_weights

    with nullcontext() if reads_base_weights(ctx.config) else empty_weights():
        model = ctx.load_model()
    return model, source_of(model)


def init_process_group() -> None:
    import torch.distributed as dist

    from .sharded import process_group_backend, rank_environment

    if not dist.is_initialized():
        rank_environment()
        dist.init_process_group(backend=process_group_backend())


class FSDPLearner(Learner):
    no_grad = staticmethod(torch.no_grad)

    def __init__(self, ctx: BackendContext) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        from ..models.device import role_device

        config = ctx.config
        init_process_group()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._init_learner(config, ctx.role, seed_offset=self.rank)
        o = config.section("fsdp")
        self.device = role_device()
        model, source = _load(ctx)
        dtype = weights_dtype(model)  # a float32 head (--model.fp32_lm_head) aside
        frozen = ctx.role == "reference"  # the reference model: shards in its own dtype, no optimizer
        model = model.requires_grad_(False) if frozen else model.float()  # trained: float32 shards
        if self.cfg.gradient_checkpointing and not frozen:
            enable_checkpointing(model)
        if self.cfg.compile and not frozen:  # inside each FSDP unit: its gathered weights, compiled kernels
            from ..models.compiled import compile_blocks

            compile_blocks(model, self.device, self.role, self.cfg.compile_scope, self.cfg.compile_mode)
        if not o.offload_params and source is None:
            model = model.to(self.device)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        compute = None if dtype == torch.float32 or frozen else dtype
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if o.offload_params else OffloadPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, reshard_after_forward=o.reshard_after_forward, offload_policy=offload,
                        mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32))
        # the root takes the batch as it is (its floating tensors are not inputs to cast); it computes in
        # float32 under --model.fp32_lm_head (its head's logits; a tied embedding's output is cast back)
        root_compute = None if config.model.fp32_lm_head else compute
        self.root = fully_shard(LearnerForward(model, self.forward), mesh=mesh, offload_policy=offload,
                                reshard_after_forward=o.reshard_after_forward,
                                mp_policy=MixedPrecisionPolicy(param_dtype=root_compute, reduce_dtype=torch.float32,
                                                               cast_forward_inputs=False))
        #: bytes this rank read of the checkpoint (its own rows of every tensor; 0: loaded whole)
        self.shard_bytes_read = 0 if source is None else load_shards(
            model, source, torch.device("cpu") if o.offload_params else self.device, dtype)
        self.forward = _call
        self.model = model
        if frozen:
            return
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = make_optimizer([p for _, p in named], self.cfg, self.lr, [name for name, _ in named],
                                        undecayed(self.model))
        self.scheduler = make_scheduler(self.optimizer, config, self.cfg)
        self._keep_average()

    # --- the update loop's parts -------------------------------------------------------
    def _module(self) -> Any:
        return self.root

    def _packed_model(self, module: Any) -> Any:
        return self.model  # what the root's forward hands the packed forward

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _step(self) -> float:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(_full(norm))

    def _lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # --- weights ---------------------------------------------------------------------
    def raw_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors, gathered one at a time (every rank iterates; each receives the full tensor)."""
        return self._gathered()

    def trained_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The trained tensors alone, gathered (a LoRA adapter's: the frozen base is not gathered)."""
        return self._gathered(trainable_only=True)

    def _gathered(self, trainable_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, each gathered in turn (a tied one once)."""
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        for name, tensor in self._tensors().items():
            if not trainable_only or name in trainable:
                yield name, _full(tensor).detach()

    def _tensors(self) -> dict[str, torch.Tensor]:
        from ..models.weights import tied_aliases

        aliases = tied_aliases(self.model)
        return {n: t for n, t in self.model.state_dict().items() if n not in aliases}

    def save(self, path: str) -> None:
        """A ``save_pretrained`` folder written by rank 0, tensor by tensor (no rank holds the model)."""
        from .sharded import save_gathered

        sizes = {n: t.numel() * t.element_size() for n, t in self._tensors().items()}
        save_gathered(self.model, path, self.rank, lambda trainable: self._gathered(trainable), sizes)

    def save_checkpoint(self, path: str) -> None:
        """A ``torch.distributed.checkpoint`` folder of the sharded weights and optimizer states
        (every rank writes its shards; collective), the schedule, and each rank's counters and
        random state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        weights, optimizer = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": weights, "optimizer": optimizer}, checkpoint_id=str(folder / "fsdp"))
        torch.save(self.scheduler.state_dict(), folder / f"scheduler-rank{self.rank}.pt")  # every node has one
        self._save_progress(folder / f"learner-rank{self.rank}.pt")

    def load_checkpoint(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from ..errors import UsageError

        folder = Path(path)
        if not (folder / "fsdp").is_dir():
            raise UsageError(f"no FSDP checkpoint under '{folder}' (expected its 'fsdp' folder): was it saved "
                             "with --learner.backend fsdp?")
        weights, optimizer = get_state_dict(self.model, self.optimizer)
        state = {"model": weights, "optimizer": optimizer}
        try:
            dcp.load(state, checkpoint_id=str(folder / "fsdp"))
        except CheckpointException as exc:  # (a BaseException) one param group saved, two made here
            if "optimizer.param_groups" in str(exc) and self.cfg.weight_decay:
                raise decayed_everything(folder) from exc
            raise
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.scheduler.load_state_dict(torch.load(folder / f"scheduler-rank{self.rank}.pt", weights_only=True))
        self._load_progress(folder / f"learner-rank{self.rank}.pt")


def _full(tensor: Any) -> torch.Tensor:
    """A DTensor's full value (collective), or the tensor itself."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor
