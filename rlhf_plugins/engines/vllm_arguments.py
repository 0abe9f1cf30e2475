"""vLLM's ``LLM`` arguments for a run: the engine's dtype, memory, context, cache and the settings the
CPU build needs, from the run's config (:class:`rlhf_plugins.engines.vllm_engine.VLLMEngine` starts vLLM
with them)."""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("rlhf_plugins")


def _recurrent(model_path: str, config: Any) -> bool:
    from transformers import AutoConfig

    from ..models.recurrent import recurrent_config

    return recurrent_config(AutoConfig.from_pretrained(model_path, trust_remote_code=config.model.trust_remote_code))


def float32_head_supported() -> bool:
    """Whether this vLLM computes a generation model's logits in the ``head_dtype`` its config names
    (``hf_overrides``), as ``--model.fp32_lm_head`` asks; a warning says so when it does not."""
    import inspect

    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    supported = "head_dtype" in inspect.getsource(LogitsProcessor)
    if not supported:
        logger.warning("this vLLM computes its logits in --model.dtype (no head_dtype); the learner's head is "
                       "float32 (--model.fp32_lm_head), the engine's is not: install a newer vllm")
    return supported


def engine_arguments(config: Any, model_path: str, cpu: bool, sleep: bool) -> dict[str, Any]:
    """vLLM's ``LLM`` arguments for this run (LoRA and tensor-parallel ones are added by the engine)."""
    from ..builtin_plugins.generation_vllm import context_length, kv_cache_bytes, starts_empty
    from ..models.memory import ModelShape

    o = config.section("vllm")
    shape = ModelShape.of_folder(model_path, config.model.trust_remote_code)
    kwargs: dict[str, Any] = dict(
        model=model_path,
        trust_remote_code=config.model.trust_remote_code,
        dtype=config.model.dtype if o.dtype == "model" else o.dtype,
        seed=config.train.seed,
        gpu_memory_utilization=o.gpu_memory_utilization or (0.2 if cpu else 0.85),
        max_model_len=context_length(config, shape.max_positions),
        enforce_eager=o.enforce_eager,
        model_impl=o.model_impl,
        enable_prefix_caching=o.enable_prefix_caching,
        tensor_parallel_size=o.tensor_parallel_size,
        logprobs_mode="processed_logprobs",
        enable_sleep_mode=sleep,
        use_tqdm_on_load=False,  # our own output says what is loading
    )
    if o.block_size:
        kwargs["block_size"] = o.block_size
    if config.model.fp32_lm_head and float32_head_supported():  # vLLM casts its head's weight and input
        kwargs["hf_overrides"] = {"head_dtype": "float32"}
    if starts_empty(config):  # the learner's weights come by sync before the first generation
        kwargs["load_format"] = "dummy"
    if o.kv_cache_mb or not o.gpu_memory_utilization:  # sized from the run, not from free memory
        sequences = config.train.prompts_per_step * config.generation.n_samples_per_prompt
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(config, shape, -(-sequences // o.num_engines))
    if cpu:
        # every request carries a seed, and vLLM rewinds a seeded request's generator after a
        # partial (chunked) prefill with CUDA-only generator calls ("CPU Generator does not use
        # offset"): on CPU, prompts are prefilled whole (vLLM then sizes a step to hold the context).
        # vLLM caches a recurrent model's prefixes only with chunked prefill (its Mamba "align" mode)
        kwargs["enable_chunked_prefill"] = False
        kwargs["enable_prefix_caching"] = o.enable_prefix_caching and not _recurrent(model_path, config)
    return kwargs
