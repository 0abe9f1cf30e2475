"""The output head, log-softmax and gather as one autograd function, chunk by chunk.

Training the policy needs ``log softmax(h W^T / T)[token]`` (and the entropy) for every completion
token, over a 151,936-entry vocabulary. Through autograd, each chunk of tokens is a dozen passes
over its logits (the matmul's output, its float32 copy, log-softmax and gather, then in the backward
pass the recomputation, the softmax gradient, the scatter of the gather's gradient and the casts),
and the head's weight takes part once per chunk: under autocast it is cast to 16 bits again in each
chunk's recomputation, and each chunk's weight gradient is cast back and added to the float32
gradient on its own. That is what kept training at 0.16-0.20 of the matmul peak on an H200
(docs/gpu.md).

Here the backward pass is written out: the gradient of the logits is ``(onehot - p) g`` (plus
``-p (log p + H) g_H`` for the entropy), computed in place in one float32 buffer per chunk, and the
weight's gradient of every chunk is accumulated in one float32 buffer and handed to autograd once --
or, for a 16-bit weight with a float32 master (``weight.main_grad``, :mod:`rlhf_plugins.learners.master_weights`),
added to the master's gradient directly, with no 16-bit gradient at all.
Values and gradients equal the unfused computation; at most one chunk of logits exists at a time.
It applies to a plain ``torch.nn.Linear`` head with ordinary tensors (not a LoRA-wrapped head, a
ZeRO-3 partition or an FSDP2 shard, whose weights are gathered by their module's own forward).

Under ``--learner.compile`` (:mod:`.compiled` marks the head) each chunk's elementwise work is compiled
too: the log-sum-exp, gather and entropy as one kernel reading the matmul's 16-bit output, and the
gradient ``(onehot - p) g`` as one kernel writing the 16-bit operand of the backward matmuls, where the
eager chunk makes about twenty float32 passes over its logits. An H100 profile (docs/gpu.md, run 5)
found those passes the largest item of the update after the matrix products.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from .float32_head import is_float32_head

#: set (to True) on a head whose chunks' elementwise work runs compiled (``--learner.compile``)
COMPILED = "rlhf_compiled_head"


def fusable(head: torch.nn.Module) -> bool:
    """Whether ``head`` is a plain linear layer whose weight is a whole, ordinary tensor."""
    if type(head) is not torch.nn.Linear:
        return False
    weight = head.weight
    return type(weight.data) is torch.Tensor and not hasattr(weight, "ds_id") and weight.device.type != "meta"


def compute_dtype(head: torch.nn.Linear) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on for the weight's device, else the
    weight's (always the weight's for a float32 head, :mod:`.float32_head`)."""
    weight = head.weight
    device = weight.device.type
    if torch.is_autocast_enabled(device) and weight.dtype == torch.float32 and not is_float32_head(head):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def head_stats(head: torch.nn.Linear, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float,
               with_entropy: bool, chunk: int, softcap: float | None = None) -> tuple[torch.Tensor, ...]:
    """(log-probs,) or (log-probs, entropy) of ``tokens`` under ``head(hidden) / temperature``,
    ``chunk`` tokens at a time; shaped as ``tokens``. ``softcap``: the logits are first soft-capped,
    ``softcap * tanh(logits / softcap)`` (Gemma 2's ``final_logit_softcapping``)."""
    shape = tokens.shape
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    dtype = compute_dtype(head)
    bias = head.bias if head.bias is not None else head.weight.new_zeros(0)
    compiled = bool(getattr(head, COMPILED, False))
    grad = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad or bias.requires_grad)
    if grad:
        out = FusedHeadStats.apply(flat_h, head.weight, bias, flat_t, (temperature, softcap), with_entropy, chunk,
                                   dtype, compiled)
    else:
        out = _forward(flat_h, head.weight.to(dtype), bias, flat_t, (temperature, softcap), with_entropy, chunk,
                       compiled)
    return tuple(o.view(shape) for o in out[: 2 if with_entropy else 1])


def wide(dtype: torch.dtype) -> torch.dtype:
    """float32, or the dtype itself when wider (float64 models keep float64 throughout)."""
    return torch.promote_types(dtype, torch.float32)


def _matmul(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``hidden W^T + b`` of one chunk in the weight's dtype (as the model's own head runs under autocast)."""
    with torch.autocast(hidden.device.type, enabled=False):
        return torch.nn.functional.linear(hidden.to(weight.dtype), weight,
                                          bias.to(weight.dtype) if bias.numel() else None)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
            scale: tuple[float, float | None]) -> torch.Tensor:
    """float32 (:func:`wide`) ``capped(hidden W^T + b) / T`` of one chunk."""
    return _scaled(_matmul(hidden, weight, bias), scale)


def _scaled(logits: torch.Tensor, scale: tuple[float, float | None]) -> torch.Tensor:
    """The head's output widened, soft-capped (``c tanh(z / c)``, when a cap is set) and divided by the
    temperature: ``scale`` is (temperature, cap)."""
    temperature, cap = scale
    z = logits.to(wide(logits.dtype))
    if cap:
        z.div_(cap).tanh_().mul_(cap)  # in place: ``logits`` is each chunk's own matmul output
    return z.div_(temperature) if temperature != 1.0 else z


def _cap_slope(z: torch.Tensor, scale: tuple[float, float | None]) -> torch.Tensor | None:
    """d capped / d logits, ``1 - tanh(z / c)^2``, from ``z`` as :func:`_scaled` returned it (``None``
    without a cap)."""
    temperature, cap = scale
    if not cap:
        return None
    t = z * (temperature / cap)  # tanh(z / c) itself
    return t.mul_(t).neg_().add_(1.0)


def _forward(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tokens: torch.Tensor,
             scale: tuple[float, float | None], with_entropy: bool, chunk: int,
             compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: log-prob of its token, entropy (zeros when not asked for) and log-sum-exp."""
    stats = _compiled(_chunk_stats) if compiled else _eager_stats
    parts = [stats(_matmul(h, weight, bias), t, scale, with_entropy)
             for h, t in zip(torch.split(hidden, chunk), torch.split(tokens, chunk))]
    lp, ent, lse = (torch.cat(column) for column in zip(*parts))
    return lp, ent, lse


def _eager_stats(logits: torch.Tensor, tokens: torch.Tensor, scale: tuple[float, float | None],
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_chunk_stats` with in-place steps, one float32 copy of the logits at a time."""
    z = _scaled(logits, scale)
    del logits
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return lp, torch.zeros_like(lp), lse
    p = (z - lse.unsqueeze(-1)).exp_()
    return lp, lse - p.mul_(z).sum(-1), lse


class FusedHeadStats(torch.autograd.Function):
    """Log-probs and entropy of a linear head's output with the backward pass written out (see the module)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tokens: torch.Tensor,
                scale: tuple[float, float | None], with_entropy: bool, chunk: int, dtype: torch.dtype,
                compiled: bool) -> tuple[torch.Tensor, ...]:
        w = weight.to(dtype)
        lp, ent, lse = _forward(hidden, w, bias, tokens, scale, with_entropy, chunk, compiled)
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, ent)
        ctx.scale, ctx.with_entropy, ctx.chunk, ctx.dtype = scale, with_entropy, chunk, dtype
        ctx.compiled = compiled
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # an output the loss does not use gives None, not zeros to work through
        return lp, ent, lse

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, _: Any) -> tuple[Any, ...]:
        hidden, weight, bias, tokens, lse, ent = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype)
        g_ent = g_ent.to(lse.dtype) if ctx.with_entropy and g_ent is not None else None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        main = getattr(weight, "main_grad", None) if need_w else None  # a float32 master's gradient
        if main is not None and (main.shape != weight.shape or main.dtype != torch.float32):
            main = None
        grad_w = main if main is not None else (
            torch.zeros(weight.shape, dtype=wide(weight.dtype), device=weight.device) if need_w else None)
        grad_b = torch.zeros(bias.shape, dtype=wide(bias.dtype), device=bias.device) if need_b else None
        compiled = _compiled(_chunk_grad) if ctx.compiled else None
        start = 0
        for h, t in zip(torch.split(hidden, ctx.chunk), torch.split(tokens, ctx.chunk)):
            part = slice(start, start + len(t))
            start += len(t)
            entropy = None if g_ent is None else (ent[part], g_ent[part])
            if compiled is not None:
                g16, g_sum = compiled(_matmul(h, w, bias), t, lse[part], g_lp[part], entropy, ctx.scale,
                                      w.dtype, grad_b is not None)
            else:
                g = _eager_grad(_logits(h, w, bias, ctx.scale), t, lse[part], g_lp[part], entropy, ctx.scale)
                g_sum = g.sum(0) if grad_b is not None else None
                g16 = g.to(w.dtype)
                del g
            if grad_b is not None:
                grad_b += g_sum
            if grad_h is not None:
                grad_h[part] = (g16 @ w).to(hidden.dtype)
            if grad_w is not None:
                _accumulate(grad_w, g16.t(), h.to(w.dtype))
        grad_w = None if main is not None else _like(grad_w, weight)  # added to main_grad already
        return grad_h, grad_w, _like(grad_b, bias), None, None, None, None, None, None


def _like(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor | None:
    return None if grad is None else grad.to(param.dtype)


def _eager_grad(z: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor, g_lp: torch.Tensor,
                entropy: tuple[torch.Tensor, torch.Tensor] | None, scale: tuple[float, float | None]) -> torch.Tensor:
    """d loss / d head output of one chunk from ``z`` as :func:`_scaled` returned it (overwritten)."""
    slope = _cap_slope(z, scale)
    g = _logits_grad(z, tokens, lse, g_lp, entropy, scale[0])
    return g if slope is None else g.mul_(slope)


def _logits_grad(z: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor, g_lp: torch.Tensor,
                 entropy: tuple[torch.Tensor, torch.Tensor] | None, temperature: float) -> torch.Tensor:
    """d loss / d logits of one chunk, in place of ``z`` (the chunk's scaled float32 logits):
    ``(onehot - p) g_lp - p (log p + H) g_H``, divided by the temperature."""
    logp = z.sub_(lse.unsqueeze(-1))
    if entropy is None:
        g = logp.exp_().mul_(-g_lp.unsqueeze(-1))
    else:
        ent, g_ent = entropy
        p = logp.exp()
        g = p.mul_(logp.add_(ent.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1)).add_(g_lp.unsqueeze(-1))).neg_()
        del logp
    rows = torch.arange(len(tokens), device=g.device)
    g[rows, tokens] += g_lp
    return g.div_(temperature) if temperature != 1.0 else g


def _chunk_stats(logits: torch.Tensor, tokens: torch.Tensor, scale: tuple[float, float | None],
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_forward`'s per-token outputs for one chunk, from the head's matmul output as it is
    (compiled: one kernel reads it and never writes a float32 copy)."""
    temperature, cap = scale
    z = logits.to(wide(logits.dtype))
    if cap:
        z = torch.tanh(z / cap) * cap
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
    ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else torch.zeros_like(lp)
    return lp, ent, lse


def _chunk_grad(logits: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor, g_lp: torch.Tensor,
                entropy: tuple[torch.Tensor, torch.Tensor] | None, scale: tuple[float, float | None],
                dtype: torch.dtype, with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_eager_grad` written without in-place steps (for the compiler), returned in the matmul
    dtype, with its sum over the chunk's tokens (the bias's gradient) when asked for."""
    temperature, cap = scale
    z = logits.to(lse.dtype)
    if cap:
        capped = torch.tanh(z / cap)
        z = capped * cap
    if temperature != 1.0:
        z = z / temperature
    logp = z - lse.unsqueeze(-1)
    p = logp.exp()
    g_lp = g_lp.unsqueeze(-1)
    onehot = torch.arange(z.shape[-1], device=z.device) == tokens.unsqueeze(-1)
    g = torch.where(onehot, g_lp, 0.0) - p * g_lp
    if entropy is not None:
        ent, g_ent = entropy
        g = g - p * (logp + ent.unsqueeze(-1)) * g_ent.unsqueeze(-1)
    if temperature != 1.0:
        g = g / temperature
    if cap:
        g = g * (1.0 - capped * capped)
    return g.to(dtype), (g.sum(0) if with_bias else None)


@functools.cache
def _compiled(fn: Any) -> Any:
    """``fn`` compiled once per process, shapes dynamic (chunks of other lengths reuse its kernels)."""
    return torch.compile(fn, dynamic=True)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in float32 and ``a``, ``b`` in the matmul dtype: in one GEMM
    with a float32 output where the device has it (CUDA), else through the 16-bit product."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _float32_output(acc.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += a @ b


@functools.cache
def _float32_output(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(..., out_dtype=float32)`` runs for ``dtype`` inputs on ``device`` (CUDA
    builds of recent torch), checked once on a small product against the two-step result."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(4, 8, dtype=dtype, device=device)
        acc = torch.ones(4, 4, device=device)
        torch.addmm(acc, a, a.t(), out_dtype=torch.float32, out=acc)
        return bool((acc == 9).all())
    except (RuntimeError, TypeError):
        return False
