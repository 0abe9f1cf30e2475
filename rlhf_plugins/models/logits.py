"""Log-probs and entropy over a real vocabulary without ``[batch, length, vocab]`` logits.

A 151,936-token vocabulary turns 16 samples x 512 tokens into 5 GB of float32 logits, and their
log-softmax and gradient as much again: more than the 0.5B model itself. Instead, the model's own
forward runs with its output head *deferred* (forward hooks make the head hand back its input, the
final hidden states, and compute nothing), and the head is then applied to a few hundred tokens at a
time. Each chunk's logits live only inside that chunk: in training the chunk is recomputed in the
backward pass (with the backward written out for a plain linear head, :mod:`.fused_head`; else
``torch.utils.checkpoint``), so the gradients are those of the unchunked computation while at most
one chunk of logits exists at any moment.

``--learner.logits_memory_mb`` is the budget of one chunk (float32 logits, their softmax and their
gradient); 0 computes the whole batch's logits at once, as the model's own forward does. Soft-capped
logits (Gemma 2's ``final_logit_softcapping``: ``c tanh(z / c)``, the same formula in every model
that has the setting) are capped chunk by chunk too, the model's own capping switched off while its
head is deferred. Logits a model scales by a number (Cohere's ``logit_scale``, Granite's
``logits_scaling``, Falcon-H1's ``lm_head_multiplier``: multiplied by some, divided by others) need
nothing: the model's forward scales what its deferred head hands back, the hidden states, and a linear
head without a bias maps ``s h`` to ``s W h``, the scaled logits (a head with a bias would not: such a
model computes its logits whole).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

import torch

from .fused_head import fusable, head_stats, wide
from .model_parts import model_config, output_embeddings

#: bytes one token's logits cost inside a chunk: float32 logits, their softmax, and their gradient
BYTES_PER_LOGIT = 12
#: what soft-capped logits add: the cap's slope, kept for the gradient
SOFTCAP_BYTES_PER_LOGIT = 4
#: the config attribute of soft-capped logits (``c tanh(z / c)``)
SOFTCAP = "final_logit_softcapping"
#: config attributes of architectures whose forward scales the head's output by a number (each its own way)
HEAD_SCALING = ("logit_scale", "logits_scaling", "lm_head_multiplier")


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] without materialising the full log-softmax (in float32, or float64
    for float64 logits)."""
    logits = logits.to(wide(logits.dtype))
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.to(wide(logits.dtype))
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def token_stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                with_entropy: bool) -> tuple[torch.Tensor, ...]:
    """(log-probs,) or (log-probs, entropy) of ``tokens`` under ``logits`` at ``temperature``."""
    logits = logits.to(wide(logits.dtype))  # scaled in float32, not in the head's 16 bits
    if temperature != 1.0:
        logits = logits / temperature
    lp = logprobs_from_logits(logits, tokens)
    return (lp, entropy_from_logits(logits)) if with_entropy else (lp,)


def bytes_per_logit(softcap: float | None = None) -> int:
    """Bytes one logit costs inside a chunk (more when soft-capped)."""
    return BYTES_PER_LOGIT + (SOFTCAP_BYTES_PER_LOGIT if softcap else 0)


def chunk_tokens(vocab: int, budget_mb: float, softcap: float | None = None) -> int:
    """Tokens per chunk under a budget of ``budget_mb`` MiB (0: no chunking)."""
    if budget_mb <= 0:
        return 0
    return max(1, int(budget_mb * 2**20) // (vocab * bytes_per_logit(softcap)))


def logit_softcap(config: Any) -> float | None:
    """The soft cap a model's forward puts on its logits (``None``: none)."""
    cap = getattr(config, SOFTCAP, None)
    return float(cap) if cap else None


def scales_logits(config: Any) -> bool:
    """Whether the model's forward scales its head's output (or input) by a number."""
    return any(getattr(config, key, None) not in (None, 1, 1.0) for key in HEAD_SCALING)


def output_head(model: Any) -> torch.nn.Module | None:
    """The model's language-model head when its logits can be computed from the head's output chunk by
    chunk (as they are, soft-capped, or scaled by a number the model's forward applies to what the
    deferred head returns); ``None`` otherwise (no head found, or scaled logits from a head with a bias).
    Sees through a DeepSpeed engine and a PEFT wrapper."""
    head = output_embeddings(model)
    if head is None or _vocab(head) is None:
        return None
    biased = getattr(getattr(head, "base_layer", head), "bias", None) is not None
    return None if biased and scales_logits(model_config(model)) else head


def _vocab(head: torch.nn.Module) -> int | None:
    # out_features stays right under ZeRO-3, where the weight itself is a partition
    size = getattr(head, "out_features", None)
    return int(size) if isinstance(size, int) else None


class HeadChunks(NamedTuple):
    """How a model's logits are computed chunk by chunk: its head, tokens per chunk, the soft cap, and
    the config whose own capping is switched off while the head is deferred."""

    head: torch.nn.Module
    chunk: int
    softcap: float | None
    config: Any


def chunking(model: Any, n_tokens: int, budget_mb: float) -> HeadChunks | None:
    """How to chunk when ``n_tokens`` of logits exceed the budget and the head can be deferred;
    ``None`` when the model's own forward should compute the logits."""
    if budget_mb <= 0:
        return None
    head = output_head(model)
    if head is None:
        return None
    config = model_config(model)
    softcap = logit_softcap(config)
    chunk = chunk_tokens(_vocab(head) or 1, budget_mb, softcap)
    return HeadChunks(head, chunk, softcap, config) if n_tokens > chunk else None


def contiguous_head_input(model: Any) -> None:
    """Hand the model's output head a contiguous input. ``logits_to_keep`` gives it a strided slice of
    the hidden states (the last ``k`` of ``T`` positions per sample), and for a frozen 16-bit head
    torch's CPU matmul then multiplies sample by sample against a copy of the weight expanded to the
    batch: B x the head's weight, 1.09 GB for the prefill of 4 prompts on the Qwen2.5-0.5B shape in
    bfloat16 (measured), where the contiguous slice costs B x k x hidden."""
    head = output_embeddings(model)
    if head is not None:
        head.register_forward_pre_hook(_contiguous_first)


def _contiguous_first(module: Any, args: tuple) -> tuple | None:
    if args and torch.is_tensor(args[0]) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


@contextmanager
def head_deferred(chunks: HeadChunks) -> Iterator[None]:
    """Inside, every call of the head returns its input (the final hidden states) and computes no
    logits: the model's forward then returns hidden states where it would return logits, with every
    slice it takes of them (``logits_to_keep``) already applied, and without its soft cap."""
    head, inputs = chunks.head, []

    def before(module: Any, args: tuple) -> tuple:
        inputs.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    def after(module: Any, args: tuple, output: Any) -> torch.Tensor:
        return inputs.pop()

    handles = [head.register_forward_pre_hook(before), head.register_forward_hook(after)]
    if chunks.softcap:
        setattr(chunks.config, SOFTCAP, None)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if chunks.softcap:
            setattr(chunks.config, SOFTCAP, chunks.softcap)


def head_token_stats(head: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float,
                     with_entropy: bool, chunk: int, softcap: float | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`token_stats` of ``head(hidden)`` (soft-capped at ``softcap``) computed ``chunk`` tokens at
    a time. With gradients, each chunk is recomputed in the backward pass, so no more than one chunk of
    logits is alive: by :mod:`.fused_head` for a plain linear head, else through autograd and
    ``torch.utils.checkpoint``."""
    if fusable(head):
        return head_stats(head, hidden, tokens, temperature, with_entropy, chunk, softcap)
    shape = tokens.shape
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    fn = partial(_chunk_stats, head, temperature, with_entropy, softcap)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    parts = []
    for h, t in zip(torch.split(flat_h, chunk), torch.split(flat_t, chunk)):
        if grad:
            from torch.utils.checkpoint import checkpoint

            parts.append(checkpoint(fn, h, t, use_reentrant=False))
        else:
            parts.append(fn(h, t))
    return tuple(torch.cat(column).view(shape) for column in zip(*parts))


def _chunk_stats(head: torch.nn.Module, temperature: float, with_entropy: bool, softcap: float | None,
                 hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logits = head(hidden)
    if softcap:
        logits = torch.tanh(logits.to(wide(logits.dtype)) / softcap) * softcap
    return token_stats(logits, tokens, temperature, with_entropy)
