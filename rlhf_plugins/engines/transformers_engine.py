"""Generation with a transformers model in the engine's process.

A lean sampling loop over the model's KV cache (no ``generate()`` machinery):
left-padded prompts, temperature / top-k / top-p, per-token log-probs, early exit
when every sample has finished. The KV cache reserves room for prompt + budget
(:mod:`rlhf_plugins.models.kv_cache`) instead of growing by concatenation.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..models import attention, empty_init, speedups
from ..models.forward import position_ids
from ..models.hf_names import cache_argument, cache_name, output_cache
from ..models.kv_cache import SHARED_PREFIX_MIN_PROMPT, reserved_cache, shared_prefix_cache
from ..models.recurrent import keeps_recurrent_state
from ..models.weights import load_named_weights
from ..protocols import BackendContext, Samples, SamplingParams
from .static_decode import StaticDecode
from .stop_strings import StopStrings


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Tempered ``logits`` with the tokens min-p, top-k and top-p leave out at -inf (in that order, as vLLM)."""
    if min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` by inverse-CDF sampling with the given uniforms in [0, 1):
    exact for the categorical distribution, and it needs one random number per row instead of one
    per vocabulary entry (``torch.multinomial`` and the exponential race are bound by that RNG).
    A token of probability 0 is never drawn (its CDF step has zero width)."""
    cdf = probs.cumsum(-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


class TransformersEngine:
    """Engine of the ``transformers`` generation backend."""

    #: fixed-shape decode steps also without CUDA graphs (tests compare them with the growing cache)
    fixed_shapes = False

    def __init__(self, ctx: BackendContext) -> None:
        from transformers import AutoTokenizer

        from ..models.device import role_device

        self.device = role_device()
        self.model = load_engine_model(ctx, self.device)
        tokenizer = AutoTokenizer.from_pretrained(ctx.model_path, trust_remote_code=ctx.config.model.trust_remote_code)
        self.tokenizer = tokenizer  # stop strings are matched on decoded text
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = torch.tensor(sorted({i for i in eos + [tokenizer.eos_token_id] if i is not None}),
                                    device=self.device)
        #: decode steps read each prompt's keys and values once for all its samples (cascade attention)
        self.shared_prefix = attention.enable(self.model)
        #: some layers keep a recurrent state, which samples of one prompt cannot share
        self.recurrent = keeps_recurrent_state(self.model)
        #: on a GPU, decode steps of one fixed shape replayed as a CUDA graph (:mod:`.static_decode`)
        self.cuda_graphs = ctx.config.generation.cuda_graphs and self.device.type == "cuda"

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Samples:
        empty_init.check_filled(self.model, "the generation engine")
        device = self.device
        input_ids, attention = left_pad(prompt_ids, self.pad_id)
        n = params.n
        if self.recurrent:  # a recurrent state (Mamba, gated delta-net layers) is not shared: each sample prefills
            input_ids, attention, n = input_ids.repeat_interleave(n, dim=0), attention.repeat_interleave(n, dim=0), 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        U, P = input_ids.shape
        pos = position_ids(attention)
        # prefill each prompt once, then share its KV cache among its n samples (prefix sharing): kept
        # once per prompt and read once per decode step for all its samples (cascade attention), or
        # repeated per sample; either cache reserves room for the whole budget (no per-step copy of it)
        shared = n > 1 and self.shared_prefix and P >= SHARED_PREFIX_MIN_PROMPT
        cache = (shared_prefix_cache(self.model, attention, params.max_new_tokens) if shared
                 else reserved_cache(self.model, P + params.max_new_tokens) if speedups.enabled() else None)
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **(cache_argument(self.model, cache) if cache is not None else {}))
        if n > 1:
            output_cache(out).batch_repeat_interleave(n)
            out.logits = out.logits.repeat_interleave(n, dim=0)
            attention = attention.repeat_interleave(n, dim=0)
            pos = pos.repeat_interleave(n, dim=0)
        mask = torch.ones((U * n, P + params.max_new_tokens), dtype=attention.dtype, device=device)
        mask[:, :P] = attention
        next_pos = pos[:, -1:] + 1
        if cache is not None and (self.cuda_graphs or self.fixed_shapes):
            step = StaticDecode(self.model, output_cache(out), mask, next_pos, params.max_new_tokens, shared,
                                graph=self.cuda_graphs).step
        else:
            step = self._growing_step(output_cache(out), mask, next_pos, P, cache if shared else None)
        seen = None
        if params.repetition_penalty != 1.0:  # each sample's prompt tokens (pads left out), then its own
            V = out.logits.shape[-1]
            index = input_ids.repeat_interleave(n, dim=0).masked_fill(attention == 0, V)
            seen = torch.zeros((index.shape[0], V + 1), dtype=torch.bool, device=device).scatter_(1, index, True)[:, :V]
        return self._decode(out.logits[:, -1, :], params, step, seen)

    def _growing_step(self, past: Any, mask: torch.Tensor, next_pos: torch.Tensor, prompt_width: int,
                      shared: Any) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """Decode steps over a cache that grows by one position a step; ``shared``: the shared-prefix
        cache (its cascade masks the prompts), or None."""
        state = {"past": past, "pos": next_pos}
        name = cache_name(self.model)

        def step(token: torch.Tensor, t: int) -> torch.Tensor:
            out = self.model(input_ids=token[:, None],
                             attention_mask=None if shared is not None else mask[:, : prompt_width + t + 1],
                             position_ids=state["pos"], use_cache=True, **{name: state["past"]},
                             **({"shared_prefix": shared} if shared is not None else {}))
            state["past"], state["pos"] = output_cache(out), state["pos"] + 1
            return out.logits[:, -1, :]
        return step

    def _decode(self, logits: torch.Tensor, params: SamplingParams, step: Callable[[torch.Tensor, int], torch.Tensor],
                seen: torch.Tensor | None = None) -> Samples:
        """Sample token by token from the prefill's last ``logits``, feeding each token to ``step``,
        until every sample stopped or the budget is spent; ``seen``: the repetition penalty's tokens."""
        B, device = logits.shape[0], self.device
        tokens = torch.full((B, params.max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        logps = torch.zeros((B, params.max_new_tokens), device=device)
        lengths = torch.full((B,), params.max_new_tokens, dtype=torch.long, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        # drawn on the CPU whatever the device: the same seed samples the same tokens everywhere
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        uniforms = torch.rand((params.max_new_tokens, B), generator=gen).to(device)
        stopper = StopStrings(self.tokenizer, params.stop)
        for t in range(params.max_new_tokens):
            token, logp = sample_token(logits, params, uniforms[t], seen)
            token = torch.where(done, torch.full_like(token, self.pad_id), token)
            if seen is not None:
                seen[torch.arange(B, device=device), token] |= ~done
            tokens[:, t] = token
            logps[:, t] = logp.masked_fill(done, 0.0)
            finished_now = ~done & torch.isin(token, self.eos_ids)
            if stopper:
                finished_now |= stopper.hit(tokens, t, ~done & ~finished_now)
            lengths = torch.where(finished_now, torch.full_like(lengths, t + 1), lengths)
            done = done | finished_now
            if bool(done.all()) or t + 1 == params.max_new_tokens:
                break
            logits = step(token, t)
        return to_samples(tokens.cpu(), logps.cpu(), lengths.cpu(), done.cpu(), params.n)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        return load_named_weights(self.model, named_tensors, materialize_on=self.device)

    #: a sync's buckets are copied in as they arrive: nothing here needs a layer's tensors together
    load_weights_part = load_weights

    def finish_weights(self) -> dict[str, Any]:
        return {}

    def load_adapter(self, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, Any]:
        """LoRA adapter sync: wrap the model with PEFT once, then load the adapter's tensors."""
        from peft import get_peft_model, set_peft_model_state_dict

        from ..models.lora import lora_config_from_dict, lora_config_of, quiet_peft_wrapping

        if lora_config_of(self.model) is None:
            with quiet_peft_wrapping():
                self.model = get_peft_model(self.model, lora_config_from_dict(config)).eval().requires_grad_(False)
        result = set_peft_model_state_dict(self.model, weights)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            from ..models.weights import WeightSyncError

            raise WeightSyncError(f"adapter sync: the engine has no LoRA tensor named '{unexpected[0]}'")
        return {"tensors": len(weights)}

    def share_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> bool:
        """Point the parameters at shared tensors (IPC sync) when every one matches in shape,
        dtype and device; later updates of the shared memory reach the model with no copy."""
        params = dict(self.model.named_parameters())
        pairs = list(named)
        if not all(n in params and params[n].shape == v.shape and params[n].dtype == v.dtype
                   and (params[n].is_meta or params[n].device == v.device) for n, v in pairs):
            return False
        with torch.no_grad():
            for name, view in pairs:
                empty_init.point_at(params[name], view)
        return True

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {k: (tuple(v.shape), str(v.dtype)) for k, v in self.model.state_dict().items()}

    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Log-probs of given completions under the engine's weights (sync parity probe)."""
        from ..models.device import to_device
        from ..models.forward import policy_forward

        with torch.inference_mode():
            return policy_forward(self.model, to_device(batch, self.device))["logprobs"].cpu()

    def shutdown(self) -> None:
        pass


def load_engine_model(ctx: BackendContext, device: torch.device) -> torch.nn.Module:
    """The engine's model on ``device``, frozen; built with empty parameters (meta device, buffers
    real) when the learner's first sync brings every weight (:func:`starts_empty`) and the
    checkpoint allows it, so the engine never holds a copy it would replace at that sync."""
    from ..builtin_plugins.generation_transformers import starts_empty

    if starts_empty(ctx.config):
        with empty_init.empty_weights():
            model = ctx.load_model()
    else:
        model = ctx.load_model()
    model.eval().requires_grad_(False)
    return empty_init.move_buffers(model, device) if empty_init.source_of(model) else model.to(device)


def left_pad(prompt_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to one width: (token ids, attention mask)."""
    U, P = len(prompt_ids), max(len(p) for p in prompt_ids)
    input_ids = torch.full((U, P), pad_id, dtype=torch.long)
    attention = torch.zeros((U, P), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        input_ids[i, P - len(p) :] = torch.tensor(p)
        attention[i, P - len(p) :] = 1
    return input_ids, attention


def sample_token(last_logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor,
                 seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row at the sampling temperature (min-p / top-k / top-p filtered when asked),
    drawn by inverting the CDF at ``uniform``; and its log-prob under the penalized, tempered
    distribution before those filters (vLLM's processed log-probs are renormalized over the tokens the
    filters keep). ``seen`` ``[B, V]``: the tokens the repetition penalty applies to. Temperature 0 is
    greedy decoding, as in vLLM (log-probs then untempered)."""
    logits = last_logits.float()
    if seen is not None:
        rp = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if params.temperature <= 0:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    if params.temperature != 1.0:
        logits = logits / params.temperature
    logprobs_all = torch.log_softmax(logits, dim=-1)
    if params.top_k or params.top_p < 1.0 or params.min_p > 0:
        probs = torch.softmax(filter_logits(logits, params.top_k, params.top_p, params.min_p), -1)
    else:
        probs = logprobs_all.exp()
    token = sample_from(probs, uniform)
    return token, logprobs_all.gather(-1, token[:, None]).squeeze(-1)


def to_samples(tokens: torch.Tensor, logps: torch.Tensor, lengths: torch.Tensor, done: torch.Tensor,
               n: int) -> Samples:
    samples = Samples()
    for i in range(tokens.shape[0]):
        L = int(lengths[i])
        samples.prompt_index.append(i // n)
        samples.completion_ids.append(tokens[i, :L].tolist())
        samples.logprobs.append(logps[i, :L].tolist())
        samples.finish_reasons.append("stop" if bool(done[i]) else "length")
    return samples
