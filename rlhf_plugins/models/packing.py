"""Sequence packing: token-budget micro batches without padding.

``--learner.max_tokens_per_micro_batch N`` cuts a mini batch into micro batches of at most ``N``
real tokens (prompt + completion; a longer sample goes alone) and runs each as packed rows: the
samples' tokens back to back, position ids restarting at every sample, no attention mask --
transformers then keeps attention inside each sample (its packed-sequence mask). Models whose
attention is plain SDPA run it per sample instead (:mod:`rlhf_plugins.models.attention`): the same
result without computing the scores the mask throws away, so a micro batch is one row without a
single pad slot. For those models a GRPO batch (samples in groups of one prompt) is packed by whole
groups and each group's prompt goes into the row once, its samples' completions after it attending to
it, so the budget counts the prompt once -- the shared prompt of the padded forward
(:func:`rlhf_plugins.models.forward.completion_logits`), inside a packed row. The logits come
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
#: a micro batch's packed rows, laid out ahead of its forward (:func:`lay_out`)
LAYOUT = "packed_layout"


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


def sharing_group(model: Any, batch: dict[str, Any]) -> int:
    """How many samples' prompt a packed micro batch of ``batch`` holds once: the batch's group size
    when its samples come in groups of one prompt (``group_size``, consecutive) and ``model`` attends
    per sample (:mod:`rlhf_plugins.models.attention`, which lets a completion attend to its prompt
    elsewhere in the row); else 1, every sample whole."""
    group = int(batch.get("group_size", 1))
    if group <= 1 or batch["sequences"].shape[0] % group or keeps_recurrent_state(model):
        return 1
    return group if attention.enable(model) else 1


def token_budget_split(batch: dict[str, Any], max_tokens: int, group: int = 1) -> list[dict[str, Any]]:
    """Micro batches of ``batch`` whose real tokens add up to at most ``max_tokens`` (a sample longer
    than the budget is one of its own), each marked for the packed forward. Samples are placed longest
    first, each in the first micro batch with room for it (first-fit decreasing), so few micro batches
    carry the whole budget; each keeps its samples' places in ``batch`` under ``"rows"`` (the gradient
    of a sum over micro batches does not depend on how samples are grouped). With ``group`` > 1
    (:func:`sharing_group`) a group's samples are placed together, counting their prompt once (a group
    longer than the budget in runs that fit it)."""
    lengths = batch["attention_mask"].sum(-1).tolist()
    units, sizes = [[i] for i in range(len(lengths))], lengths
    if group > 1:
        prompts = batch["attention_mask"][:, : -batch["action_mask"].shape[1]].sum(-1).tolist()
        units, sizes = _prompt_units(lengths, prompts, group, max_tokens)
    out = []
    for placed in first_fit(sizes, max_tokens):
        idx = [i for u in placed for i in units[u]]
        part = {k: (v[idx] if torch.is_tensor(v) else [v[i] for i in idx] if isinstance(v, list) else v)
                for k, v in batch.items()}
        part[PACKED], part["rows"], part["group_size"] = True, torch.tensor(idx), group
        out.append(part)
    return out


def _prompt_units(lengths: list[int], prompts: list[int], group: int,
                  max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Each group's samples in runs that fit ``max_tokens`` with their prompt counted once (a group
    too long for it is cut into consecutive runs, each holding the prompt; a sample too long alone is
    a run of its own), and each run's tokens."""
    units, sizes = [], []
    for first in range(0, len(lengths), group):
        for i in range(first, first + group):
            completion = lengths[i] - prompts[i]
            if i > first and sizes[-1] + completion <= max_tokens:
                units[-1].append(i)
                sizes[-1] += completion
            else:
                units.append([i])
                sizes.append(lengths[i])
    return units, sizes


def packed_completion_logits(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Next-token logits ``[B, T, V]`` of the completion tokens, computed on packed rows.

    A model whose attention runs per sample (:func:`rlhf_plugins.models.attention.enable`) takes the
    whole micro batch as one row, without a pad slot; a micro batch placed by groups of one prompt
    (``group_size`` > 1, :func:`token_budget_split`) holds each run of samples' prompt once, followed by
    their completions, each attending to it. Otherwise attention goes through a
    block-diagonal mask and costs a row's length squared, so the samples are packed first-fit
    (longest first) into rows as long as the longest sample: no row costs more than a padded one,
    and the rows carry few pad slots. Pad slots at a row's end form a sequence of their own
    (positions restart), and nothing reads them. A model with recurrent layers (Mamba: their state
    would run from one sample into the next) gets one sample a row."""
    ids, pos, extra, flat, _ = batch.get(LAYOUT) or _layout(model, batch)
    logits = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False, **extra).logits
    # index_select, whose backward adds rows back, not advanced indexing (a sorting index_put)
    return logits.reshape(-1, logits.shape[-1]).index_select(0, flat.reshape(-1)).view(*flat.shape, -1)


def lay_out(model: Any, parts: list[dict[str, Any]]) -> None:
    """Lay out the packed rows of every micro batch in ``parts`` now, kept in each under ``LAYOUT``: a
    micro batch is read on the host to be laid out, and on a GPU that read waits for every queued kernel,
    so done between one micro batch's backward and the next one's forward it left the GPU idle while
    the host laid out rows and then issued the forward. Before the first forward nothing is queued."""
    for part in parts:
        if part.get(PACKED):
            part[LAYOUT] = _layout(model, part)


def _layout(model: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """(token ids, position ids, the model's extra arguments, the flat index of each completion token's
    logits, which slots hold a real token rather than padding) of a micro batch's packed rows, on its
    device."""
    device = batch["sequences"].device
    # laid out on the host from one copy of the micro batch (a read of the device per sample would wait
    # for its queued kernels each time), moved to the device once
    seq, mask, T = batch["sequences"].cpu(), batch["attention_mask"].bool().cpu(), batch["action_mask"].shape[1]
    recurrent = keeps_recurrent_state(model)  # a state runs along a row: one sample a row, its pad slots after it
    per_sample = not recurrent and attention.enable(model)
    if per_sample and int(batch.get("group_size", 1)) > 1:  # placed by :func:`token_budget_split`'s groups
        ids, pos, samples, flat = _shared_prompt_row(seq, mask, T)
        real = torch.ones_like(ids, dtype=torch.bool)  # one row without a pad slot
    else:
        ids, pos, samples, flat, real = _sample_rows(seq, mask, T, per_sample, recurrent)
    extra = {"packed_samples": samples} if per_sample else {}
    return ids.to(device), pos.to(device), extra, flat.to(device), real.to(device)


def real_tokens(batch: dict[str, Any]) -> torch.Tensor:
    """Which of the positions a micro batch's forward runs hold real tokens: its attention mask, or for a
    packed micro batch (laid out by :func:`lay_out`) its rows' slots other than padding."""
    return batch[LAYOUT][-1] if LAYOUT in batch else batch["attention_mask"]


def _sample_rows(seq: torch.Tensor, mask: torch.Tensor, T: int, per_sample: bool,
                 recurrent: bool) -> tuple[torch.Tensor, torch.Tensor, list[list[tuple[int, ...]]], torch.Tensor,
                                           torch.Tensor]:
    """Every sample whole in packed rows: (token ids, position ids, each row's segments, for each
    completion token the flat index of the position whose logits predict it, and the real-token slots),
    on the host."""
    B, W = seq.shape
    P = W - T
    lengths = mask.sum(-1).tolist()
    R = max(sum(lengths) if per_sample else max(lengths), 1)
    rows = [[b] for b in range(B)] if recurrent else first_fit(lengths, R)
    ids = torch.zeros((len(rows), R), dtype=seq.dtype)
    pos = torch.zeros((len(rows), R), dtype=torch.long)
    real = torch.zeros((len(rows), R), dtype=torch.bool)
    where = torch.zeros((B, 2), dtype=torch.long)  # (row, offset) of each sample
    samples: list[list[tuple[int, ...]]] = []  # (start, length) of each sample of a row, pad slots last
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
        real[r, :offset] = True
        samples.append(samples_r + ([(offset, R - offset)] if offset < R else []))
    # completion token k of sample b sits at offset + prompt_len + k of its row and is predicted by
    # the logits one position before it
    k = torch.arange(T)
    col = (where[:, 1] + mask[:, :P].sum(-1))[:, None] + k[None, :] - 1
    col = torch.where(mask[:, P:], col, torch.zeros_like(col)).clamp(min=0)
    return ids, pos, samples, where[:, :1] * R + col, real


def _shared_prompt_row(seq: torch.Tensor, mask: torch.Tensor,
                       T: int) -> tuple[torch.Tensor, torch.Tensor, list[list[tuple[int, ...]]], torch.Tensor]:
    """:func:`_sample_rows` for samples in groups of one prompt: one row holding each prompt once, then
    the completions of the consecutive samples with that prompt (positions continuing the prompt's),
    each a segment attending to its prompt's."""
    B, W = seq.shape
    P = W - T
    parts: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    segments: list[tuple[int, ...]] = []
    col = torch.zeros((B, T), dtype=torch.long)
    offset, prompt = 0, None
    for b in range(B):
        own = seq[b, :P][mask[b, :P]]
        if prompt is None or not torch.equal(own, prompt):  # a new prompt (a group, or part of one)
            prompt, n = own, len(own)
            parts.append(prompt)
            positions.append(torch.arange(n))
            prompt_index, last = len(segments), offset + n - 1
            segments.append((offset, n))
            offset += n
        completion = seq[b, P:][mask[b, P:]]
        m = len(completion)
        col[b, 0] = last  # the first completion token is predicted by the prompt's last position
        col[b, 1:m] = torch.arange(offset, offset + m - 1)
        if m:
            parts.append(completion)
            positions.append(torch.arange(n, n + m))
            segments.append((offset, m, prompt_index))
            offset += m
    return torch.cat(parts)[None], torch.cat(positions)[None], [segments], col


def in_token_budget(fn: Callable[[dict[str, Any]], torch.Tensor], batch: dict[str, Any],
                    max_tokens: int, model: Any = None) -> torch.Tensor:
    """``fn`` (a no-grad per-token pass of ``model``, ``[b, T]``) over token-budget micro batches,
    concatenated; each prompt once for its group where ``model`` allows (:func:`sharing_group`)."""
    if not max_tokens:
        return fn(batch)
    parts = token_budget_split(batch, max_tokens, 1 if model is None else sharing_group(model, batch))
    if model is not None:
        lay_out(model, parts)
    results = [fn(part) for part in parts]
    out = results[0].new_zeros((batch["sequences"].shape[0], *results[0].shape[1:]))
    for part, result in zip(parts, results):
        out[part["rows"]] = result
    return out
