"""The DeepSpeed learner: ZeRO stages 1-3, optimizer / parameter offload, bf16.

One instance per data-parallel rank (a Ray actor of the role group), or a single process under local
placement. The process group comes from the environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK): NCCL on GPU, gloo on CPU. Gradient accumulation is ours (``managed_gradient_accumulation:
false``): one ``backward`` per micro batch, one ``step`` per mini batch, the micro-batch weights of the
objective keep the mini-batch mean exact.

ZeRO-3 loads through ``HfDeepSpeedConfig`` (alive during the load) so
``from_pretrained`` partitions weights as it loads; full weights are gathered per
tensor (``GatheredParameters``) for weight sync and saving.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from ..models.hf_names import enable_checkpointing
from ..protocols import BackendContext
from .base import Learner, make_scheduler
from .decay import decayed_everything
from .deepspeed_config import deepspeed_config
from .optimizer import make_optimizer, undecayed

logger = logging.getLogger("rlhf_plugins")
#: DeepSpeed checkpoint tag inside a learner's checkpoint folder
TAG = "zero"


def _saved_param_groups(tag_folder: Path) -> int | None:
    """How many param groups the optimizer of a DeepSpeed checkpoint had (its ZeRO 1-2 or ZeRO-3 optimizer
    states, the first rank's file, mapped rather than read); None where there is no such file."""
    for file in sorted(tag_folder.glob("*optim_states.pt")):
        state = torch.load(file, map_location="cpu", weights_only=False, mmap=True).get("optimizer_state_dict", {})
        inner = state.get("base_optimizer_state", state.get("optimizer_state_dict"))
        if isinstance(inner, dict) and "param_groups" in inner:
            return len(inner["param_groups"])
    return None


def share_master_weights(optimizer: Any) -> int:
    """ZeRO-3 with float32 weights: let the optimizer's float32 master partition *be* the weight
    partition. DeepSpeed means to (stage3.py: "we don't need another copy of the weights") but compares
    a torch.device with its device's name, which never match, so it clones the partition: a second
    copy of every weight (0.9 GB per rank for a 0.5B model over two ranks). The master tensors keep
    their identity (the optimizer's states are keyed by them); after a step DeepSpeed's copy of the
    master into the weights copies a tensor onto itself. Returns the bytes given back; 0 when this
    DeepSpeed's internals are not the expected ones (nothing is changed then)."""
    weights = getattr(optimizer, "fp16_partitioned_groups_flat", None)
    masters = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    if not weights or not masters or len(weights) != len(masters) or getattr(optimizer, "offload_optimizer", True):
        return 0
    freed = 0
    for weight, master in zip(weights, masters):
        if (weight is None or master is weight or weight.dtype != master.dtype or weight.device != master.device
                or weight.shape != master.shape):
            continue
        with torch.no_grad():
            master.data = weight.data
        freed += weight.numel() * weight.element_size()
    return freed


def import_deepspeed() -> Any:
    """``import deepspeed`` without the MLflow import of its autotuner, which this package never runs:
    where MLflow is installed, that import costs every learner process about a second of start-up (after
    torch and transformers, DeepSpeed imports in 0.2 s without it, 1.1-1.3 s with it; measured). MLflow
    stays importable afterwards; only the autotuner sees it as absent."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment] # Python's marker for "import fails"
    try:
        import deepspeed
    finally:
        if hide:
            del sys.modules["mlflow"]
    return deepspeed


def init_distributed() -> None:
    """Join the process group of the role's ranks (:func:`.sharded.rank_environment`)."""
    import torch.distributed as dist

    from .sharded import process_group_backend, rank_environment

    if dist.is_initialized():
        return
    rank_environment()
    deepspeed = import_deepspeed()
    # its shared-memory all-reduce serves only tensor-parallel inference; the CPU accelerator would build it (C++)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=process_group_backend(), verbose=False)


def _refuse_expert_lora(model: Any) -> None:
    """PEFT's LoRA on a mixture of experts' fused expert tensors (its parameter LoRA) stops ZeRO-3's
    first backward: DeepSpeed 0.19 asserts that no parameter comes twice in a gradient bucket. Refused
    before the engine starts; ZeRO-2 and FSDP2 train it."""
    from ..models.lora import param_wrappers

    adapted = [name for name, wrapped in param_wrappers(model).items() if wrapped.experts > 1]
    if adapted:
        raise UsageError(f"LoRA on a mixture of experts' fused expert tensors ({adapted[0]}) does not train under "
                         "DeepSpeed ZeRO-3; use --deepspeed.zero_stage 2 or --learner.backend fsdp, or leave the "
                         "experts out: --lora.target_modules q_proj,k_proj,v_proj,o_proj")


class DeepSpeedLearner(Learner):
    #: ZeRO-3 gathers a small parameter once and keeps it (below ``stage3_param_persistence_threshold``):
    #: gathered under inference mode it stays an inference tensor, and a training step that saves it for
    #: backward (a norm's weight under gradient checkpointing) failed after a log-prob pass came first
    no_grad = staticmethod(torch.no_grad)

    def __init__(self, ctx: BackendContext) -> None:
        import torch.distributed as dist

        config, role = ctx.config, ctx.role
        init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._init_learner(config, role, seed_offset=self.rank)
        self.stage = config.section("deepspeed").zero_stage
        from ..models.memory import ModelShape

        ds_config = deepspeed_config(config, role, self.world_size,
                                     ModelShape.of_folder(ctx.model_path, config.model.trust_remote_code))
        hf_ds_config = None
        if self.stage == 3:
            from transformers.integrations import HfDeepSpeedConfig

            # alive while from_pretrained runs, so it loads partitioned; dropped afterwards so that
            # other models of this process (a local reference model) load whole
            hf_ds_config = HfDeepSpeedConfig(ds_config)
        model = ctx.load_model()
        if self.stage == 3:
            _refuse_expert_lora(model)
        if self.cfg.gradient_checkpointing:
            enable_checkpointing(model)
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        params, optimizer = [p for _, p in named], None
        if self.cfg.optimizer == "muon":  # DeepSpeed's own Muon: ZeRO gathers each matrix to orthogonalise it
            from .muon import deepspeed_muon

            ds_config["optimizer"] = deepspeed_muon(self.cfg, self.lr)
            ds_config["zero_optimization"]["reduce_scatter"] = False  # DeepSpeed's Muon reduces by all-reduce
        else:
            optimizer = make_optimizer(params, self.cfg, self.lr, [name for name, _ in named], undecayed(model))
        self.engine, self.optimizer, _, self.scheduler = import_deepspeed().initialize(
            model=model, optimizer=optimizer, model_parameters=params if optimizer is None else None, config=ds_config,
            lr_scheduler=lambda opt: make_scheduler(opt, config, self.cfg))
        del hf_ds_config
        self.model = self.engine.module
        self.device = self.engine.device
        self.shared_master = share_master_weights(self.engine.optimizer) if self.stage == 3 else 0
        self._sleep = config.section("deepspeed").sleep
        self._warned_sleep = False
        self._keep_average()

    # --- the update loop's parts -------------------------------------------------------
    def _module(self) -> Any:
        return self.engine

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def _step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def _lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def train(self, batch: dict[str, Any], objective: Any) -> dict[str, float]:
        self.wake()
        metrics = super().train(batch, objective)
        self.sleep()
        return metrics

    # --- sleep between phases ------------------------------------------------------
    def sleep(self) -> None:
        """Offload optimizer and parameter states while the engine generates (GPU, ZeRO-3)."""
        if not self._sleep:
            return
        if not torch.cuda.is_available() or self.stage != 3:
            if not self._warned_sleep:
                logger.warning("deepspeed.sleep needs a GPU and ZeRO-3; states stay where they are")
                self._warned_sleep = True
            return
        self.engine.offload_states()

    def wake(self) -> None:
        if self._sleep and torch.cuda.is_available() and self.stage == 3:
            self.engine.reload_states()

    # --- weights ---------------------------------------------------------------------
    def raw_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights, one tensor at a time. Every rank must iterate (ZeRO-3 gathers are
        collective); each rank receives the full tensors."""
        return self._gathered()

    def trained_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The trained tensors alone, gathered (a LoRA adapter's: the frozen base is not gathered)."""
        return self._gathered(trainable_only=True)

    def _gathered(self, trainable_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        deepspeed = import_deepspeed()

        for name, param in self.model.named_parameters():
            if trainable_only and not param.requires_grad:
                continue
            if self.stage == 3:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    yield name, param.data.detach().clone()
            else:
                yield name, param.data.detach()

    def save(self, path: str) -> None:
        """A ``save_pretrained`` folder written by rank 0. Under ZeRO-3 the weights are gathered one
        tensor at a time and written shard by shard, so no rank ever holds the whole model."""
        from ..models.folder import save_pretrained
        from .sharded import save_gathered

        if self.stage != 3:
            if self.rank == 0:
                save_pretrained(self.model, path)
            return
        sizes = {n: int(getattr(p, "ds_numel", p.numel())) * p.element_size() for n, p in self.model.named_parameters()}
        save_gathered(self.model, path, self.rank, lambda trainable: self._gathered(trainable_only=trainable), sizes)

    def save_checkpoint(self, path: str) -> None:
        """DeepSpeed's own checkpoint (every rank writes its ZeRO partitions of the fp32 master
        weights and optimizer states; collective), plus each rank's counters and random state."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        self.wake()
        self.engine.save_checkpoint(str(folder), tag=TAG, save_latest=False)
        self._save_progress(folder / f"learner-rank{self.rank}.pt")
        self.sleep()

    def load_checkpoint(self, path: str) -> None:
        folder = Path(path)
        self.wake()
        try:
            loaded, _ = self.engine.load_checkpoint(str(folder), tag=TAG, load_optimizer_states=True,
                                                    load_lr_scheduler_states=True)
        except (RuntimeError, ValueError) as exc:  # DeepSpeed's words for a layout other than this optimizer's
            saved = _saved_param_groups(folder / TAG)
            if saved is not None and saved < len(self.engine.optimizer.param_groups):
                raise decayed_everything(folder) from exc
            raise
        if loaded is None:
            from ..errors import UsageError

            raise UsageError(f"no DeepSpeed checkpoint under '{folder}' (expected the '{TAG}' tag)")
        self._load_progress(folder / f"learner-rank{self.rank}.pt")
        self.sleep()

    def shutdown(self) -> None:
        destroy = getattr(self.engine, "destroy", None)
        if callable(destroy):
            destroy()
