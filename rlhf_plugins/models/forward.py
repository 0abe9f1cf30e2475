"""Forward passes shared by learners, the reference model and the transformers engine.

A batch is a dict of tensors: ``sequences`` (left-padded prompt + right-padded
completion, ``[B, P + T]``), ``attention_mask`` and ``action_mask`` (``[B, T]``,
1 on completion tokens).
"""
from __future__ import annotations

from typing import Any

import torch

from .hf_names import cache_argument, checkpointing, output_cache
from .logits import chunking, head_deferred, head_token_stats, token_stats
from .recurrent import keeps_recurrent_state

#: default budget of one chunk of logits (``--learner.logits_memory_mb``); see :mod:`.logits`
LOGITS_MEMORY_MB = 256.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logits(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Next-token logits ``[B, T, V]`` for the completion tokens of ``batch``.

    When the batch holds ``group_size`` consecutive samples per prompt (and the
    prompt width ``prompt_width``), each prompt is encoded once and its KV cache
    shared by its samples: the forward runs on ``B / group * P + B * T`` tokens
    instead of ``B * (P + T)``. Gradients flow through the shared prefix, also under activation
    checkpointing where the model's caches allow it (:mod:`.prompt_cache`). Models with recurrent
    layers (:mod:`.recurrent`) run every sample whole.
    """
    if batch.get("packed"):  # a token-budget micro batch: one packed row, no padding
        from .packing import packed_completion_logits

        return packed_completion_logits(model, batch)
    seq, mask = batch["sequences"], batch["attention_mask"]
    T = batch["action_mask"].shape[1]
    group = int(batch.get("group_size", 1))
    P = batch.get("prompt_width")
    if P is not None and group > 1 and seq.shape[0] % group == 0 and not keeps_recurrent_state(model):
        logits = _shared_prompt_logits(model, seq, mask, int(P), T, group)
        if logits is not None:
            return logits
    out = model(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                logits_to_keep=T + 1, use_cache=False)
    return out.logits[:, :-1, :]


def _shared_prompt_logits(model: Any, seq: torch.Tensor, mask: torch.Tensor, P: int, T: int,
                          group: int) -> torch.Tensor | None:
    """:func:`completion_logits` with each prompt encoded once for its ``group`` samples; None where the
    model cannot (checkpointed layers whose cache cannot be kept)."""
    from .compiled import layer_cache
    from .prompt_cache import cache_kept, checkpointed_layers, prompt_cache

    cache = prompt_cache(model)
    layers: list[Any] = []
    if checkpointing(model):
        layers = checkpointed_layers(model) or []
        if cache is None or not layers:
            return None
    pmask = mask[::group, :P]
    # under checkpointing the cache is passed without use_cache, which checkpointed layers would turn off
    # (with a warning): what they write goes to ``cache`` all the same
    use_cache = not layers
    with cache_kept(layers):
        out = model(input_ids=seq[::group, :P], attention_mask=pmask, position_ids=position_ids(pmask),
                    use_cache=use_cache, logits_to_keep=1,
                    **cache_argument(model, cache if cache is not None else layer_cache(model)))
        first = out.logits[:, -1:, :].repeat_interleave(group, dim=0)
        if T == 1:
            return first
        if cache is not None and not cache.written():  # the model ignored the cache: every sample whole
            return None
        if cache is not None:
            reader = cache.reader(group)
        else:
            reader = output_cache(out)
            if reader is None:  # the model made none (transformers 4.x's Gemma 2 while training): every sample whole
                return None
            reader.batch_repeat_interleave(group)
        full = mask[:, : P + T - 1]
        rest = model(input_ids=seq[:, P : P + T - 1], attention_mask=full, position_ids=position_ids(full)[:, P:],
                     use_cache=use_cache, **cache_argument(model, reader))
    return torch.cat([first, rest.logits], dim=1)


def policy_forward(
    model: Any, batch: dict[str, Any], temperature: float = 1.0, with_entropy: bool = False,
    logits_memory_mb: float = LOGITS_MEMORY_MB,
) -> dict[str, torch.Tensor]:
    """Log-probs (and entropy) of the completion tokens under ``model`` at the sampling temperature.

    When the batch's logits would exceed ``logits_memory_mb``, the model's head is applied in chunks
    of tokens (:mod:`rlhf_plugins.models.logits`): the same values and gradients, bounded memory."""
    tokens = batch["sequences"][:, -batch["action_mask"].shape[1]:]
    chunked = chunking(model, tokens.numel(), logits_memory_mb)
    if chunked is None:
        stats = token_stats(completion_logits(model, batch), tokens, temperature, with_entropy)
    else:
        with head_deferred(chunked):
            hidden = completion_logits(model, batch)
        stats = head_token_stats(chunked.head, hidden, tokens, temperature, with_entropy, chunked.chunk,
                                 chunked.softcap)
    return dict(zip(("logprobs", "entropy"), stats))


def value_forward(
    model: Any, batch: dict[str, Any], temperature: float = 1.0, with_entropy: bool = False
) -> dict[str, torch.Tensor]:
    """Critic values of the states before each completion token (aligned with log-probs)."""
    return {"values": completion_logits(model, batch)[..., 0].float()}


def split_batch(batch: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """Consecutive slices of ``size`` samples (the last may be shorter). Prompt groups stay
    shared only when ``size`` is a multiple of the group size."""
    n = batch["sequences"].shape[0]
    aligned = size % int(batch.get("group_size", 1)) == 0
    parts = []
    for i in range(0, n, size):
        part = {k: _take(v, slice(i, i + size)) for k, v in batch.items()}
        if not aligned:
            part["group_size"] = 1
        parts.append(part)
    return parts


def group_permutation(n: int, group: int, generator: torch.Generator) -> torch.Tensor:
    """A random order of ``n`` samples that keeps each prompt's ``group`` samples together."""
    if group <= 1 or n % group:
        return torch.randperm(n, generator=generator)
    groups = torch.randperm(n // group, generator=generator)
    return (groups[:, None] * group + torch.arange(group)[None, :]).reshape(-1)


def _take(v: Any, idx: slice) -> Any:
    return v[idx] if torch.is_tensor(v) or isinstance(v, list) else v

