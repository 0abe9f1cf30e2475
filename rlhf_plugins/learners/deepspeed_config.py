"""DeepSpeed's config for a learner of this run: ZeRO stage, offload, precision, and bucket sizes from the
model's shape instead of DeepSpeed's defaults. Gradient accumulation stays the learner's own."""
from __future__ import annotations

from typing import Any

import torch


def deepspeed_config(config: Any, role: str, world_size: int, shape: Any = None) -> dict[str, Any]:
    """DeepSpeed's config for this run, its buckets sized from the model's ``shape``
    (:class:`~rlhf_plugins.models.memory.ModelShape`) rather than DeepSpeed's defaults, which
    allocate 2 GB per bucket whatever the model."""
    learner, o = config.learner_of(role), config.section("deepspeed")
    stage = o.zero_stage
    zero: dict[str, Any] = {"stage": stage}
    if shape is not None:
        zero.update(zero_buckets(shape))
    if o.offload_optimizer and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if o.offload_params and stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    micro = max(1, learner.micro_batch_size or 1)
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro * world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": learner.max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if config.model.dtype == "bfloat16":
        cfg["bf16"] = {"enabled": True}
    elif config.model.dtype == "float16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return cfg


def zero_buckets(shape: Any) -> dict[str, Any]:
    """Bucket, prefetch and persistence sizes from the model (the largest layer; transformers'
    "auto" rules for the rest): a rank holds one layer's worth of gathered or reduced tensors."""
    from ..models.memory import zero_bucket_elements

    bucket = zero_bucket_elements(shape)
    return {
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "stage3_prefetch_bucket_size": int(0.9 * bucket),
        "stage3_param_persistence_threshold": 10 * shape.hidden,
        "stage3_max_live_parameters": max(shape.largest_tensor, 2 * bucket),
        "stage3_max_reuse_distance": max(shape.largest_tensor, 2 * bucket),
        # the optimizer steps one sub-group of the flat partition at a time: Adam's temporaries (sqrt of
        # the second moment, the update) are a sub-group's size, not the whole partition's (2-3 copies of
        # it with DeepSpeed's default of 1e9 elements: +10 GB at the first step of a 0.5B model)
        "sub_group_size": bucket,
    }
