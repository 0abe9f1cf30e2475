"""Sequence packing: token-budget micro batches without padding.

``--learner.max_tokens_per_micro_batch N`` cuts a mini batch into micro batches of at most ``N``
real tokens (prompt + completion; a longer sample goes alone) and runs each as packed rows: the
samples' tokens back to back, position ids restarting at every sample, no attention mask --
transformers then keeps attention inside each sample (its packed-sequence mask). Models whose
attention is plain SDPA run it per sample instead (:mod:`rlhf_plugins.models.attention`): the same
result without computing the scores the mask throws away, so a micro batch is one row without a
single pad slot. The logits come
back in the padded ``[B, T]`` layout, so losses, masks and metrics are unchanged, and the gradients
equal those of the padded computation (tested in float64 for every loss aggregation).

The learner's log-prob and value passes and the reference model's use the same budget.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import attention
from .recurrent import keeps_recurrent_state

#: a micro batch marked for the packed forward
PACKED = "packed"


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` in bins of at most ``capacity``: longest first (ties in order), each
    into the first bin with room for it (first-fit decreasing); a longer one gets a bin of its own."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = next((b for b, u in enumerate(used) if u + lengths[i] <= capacity), len(bins))
        if b == len(bins):
            bins.append([])
            used.append(0)
        bins[b].append(i)
        used[b] += lengths[i]
    return bins


def token_budget_split(batch: dict[str, Any], max_tokens: int) -> list[dict[str, Any]]:
    """Micro batches of ``batch`` whose real tokens add up to at most ``max_tokens`` (a sample longer
    than the budget is one of its own), each marked for the packed forward. Samples are placed longest
    first, each in the first micro batch with room for it (first-fit decreasing), so few micro batches
    carry the whole budget; each keeps its samples' places in ``batch`` under ``"rows"`` (the gradient
    of a sum over micro batches does not depend on how samples are grouped)."""
    groups = first_fit(batch["attention_mask"].sum(-1).tolist(), max_tokens)
    out = []
    for idx in groups:
        part = {k: (v[idx] if torch.is_tensor(v) else [v[i] for i in idx] if isinstance(v, list) else v)
                for k, v in batch.items()}
        part[PACKED], part["rows"] = True, torch.tensor(idx)
        out.append(part)
    return out


def packed_completion_logits(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Next-token logits ``[B, T, V]`` of the completion tokens, computed on packed rows.

    A model whose attention runs per sample (:func:`rlhf_plugins.models.attention.enable`) takes the
    whole micro batch as one row, without a pad slot. Otherwise attention goes through a
    block-diagonal mask and costs a row's length squared, so the samples are packed first-fit
    (longest first) into rows as long as the longest sample: no row costs more than a padded one,
    and the rows carry few pad slots. Pad slots at a row's end form a sequence of their own
    (positions restart), and nothing reads them. A model with recurrent layers (Mamba: their state
    would run from one sample into the next) gets one sample a row."""
    seq, mask = batch["sequences"], batch["attention_mask"].bool()
    B, W = seq.shape
    T = batch["action_mask"].shape[1]
    P = W - T
    lengths = mask.sum(-1).tolist()
    recurrent = keeps_recurrent_state(model)  # a state runs along a row: one sample a row, its pad slots after it
    per_sample = not recurrent and attention.enable(model)
    R = max(sum(lengths) if per_sample else max(lengths), 1)
    rows = [[b] for b in range(B)] if recurrent else first_fit(lengths, R)
    ids = torch.zeros((len(rows), R), dtype=seq.dtype, device=seq.device)
    pos = torch.zeros((len(rows), R), dtype=torch.long, device=seq.device)
    where = torch.zeros((B, 2), dtype=torch.long)  # (row, offset) of each sample
    samples: list[list[tuple[int, int]]] = []  # (start, length) of each sample of a row, pad slots last
    for r, members in enumerate(rows):
        offset, samples_r = 0, []
        for b in members:
            n = lengths[b]
            ids[r, offset:offset + n] = seq[b][mask[b]]
            pos[r, offset:offset + n] = torch.arange(n)
            where[b] = torch.tensor([r, offset])
            samples_r.append((offset, n))
            offset += n
        pos[r, offset:] = torch.arange(R - offset)
        samples.append(samples_r + ([(offset, R - offset)] if offset < R else []))
    extra = {"packed_samples": samples} if per_sample else {}
    out = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False, **extra)
    # completion token k of sample b sits at offset + prompt_len + k of its row and is predicted by
    # the logits one position before it
    prompt_len = mask[:, :P].sum(-1)
    k = torch.arange(T, device=seq.device)
    col = (where[:, 1].to(seq.device) + prompt_len)[:, None] + k[None, :] - 1
    col = torch.where(mask[:, P:], col, torch.zeros_like(col)).clamp(min=0)
    flat = where[:, 0].to(seq.device)[:, None] * R + col
    # index_select, whose backward adds rows back, not advanced indexing (a sorting index_put)
    logits = out.logits
    return logits.reshape(-1, logits.shape[-1]).index_select(0, flat.reshape(-1)).view(B, T, -1)


def in_token_budget(fn: Callable[[dict[str, Any]], torch.Tensor], batch: dict[str, Any],
                    max_tokens: int) -> torch.Tensor:
    """``fn`` (a no-grad per-token pass, ``[b, T]``) over token-budget micro batches, concatenated."""
    if not max_tokens:
        return fn(batch)
    parts = token_budget_split(batch, max_tokens)
    results = [fn(part) for part in parts]
    out = results[0].new_zeros((batch["sequences"].shape[0], *results[0].shape[1:]))
    for part, result in zip(parts, results):
        out[part["rows"]] = result
    return out
