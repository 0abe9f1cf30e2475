"""The attention our engine's and learners' models run under: SDPA, plus two cases a caller asks
for by keyword argument to the model's forward.

- ``shared_prefix=<cache>`` (the transformers engine's decode steps): cascade attention, each
  prompt's keys and values read once for all its samples (:mod:`rlhf_plugins.models.kv_cache`).
- ``packed_samples=<rows>`` (the learner's packed micro batches, :mod:`rlhf_plugins.models.packing`):
  causal attention inside each sample of a packed row, one SDPA call per sample; a row may hold a
  prompt once for its group of samples, each completion attending to it. transformers'
  block-diagonal mask computes the same thing over the whole row, ``R^2`` scores per row of ``R``
  tokens; per sample it is ``n^2 / 2`` per sample of ``n`` tokens.

Without either keyword it is exactly transformers' SDPA (with its mask), so a model enabled here
computes what it computed before for every other caller. Only models whose attention is plain SDPA
over full-attention layers (no soft-capping, sinks or sliding windows) are enabled; the others keep
their attention: the engine decodes over each sample's copy of its prompt, and packed rows go
through transformers' block-diagonal mask.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from .model_parts import model_config

#: the attention implementation name an enabled model's config carries (never saved with the model)
ATTENTION = "rlhf_sdpa"
#: attention classes whose forward is plain scaled dot-product attention over the cache's keys and
#: values, so the cascade and the per-sample attention compute the same thing as SDPA with a mask
PLAIN_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention",
                   "MixtralAttention", "Qwen2MoeAttention", "Qwen3MoeAttention",  # the mixtures of experts' alike
                   # Llama's forward with a fused qkv projection (Phi-3), RoPE skipped in some layers (SmolLM3),
                   # its own softmax scale (Granite's attention_multiplier, passed as ``scaling``), partial RoPE
                   # (GLM-4), dropout on its output (Seed-OSS)
                   "Phi3Attention", "SmolLM3Attention", "GraniteAttention", "Glm4Attention", "SeedOssAttention")
#: models found not to qualify (packing asks on every micro batch; the answer does not change)
_NOT_PLAIN: weakref.WeakSet = weakref.WeakSet()


def enable(model: Any) -> bool:
    """Run ``model`` (or the model a DeepSpeed / PEFT wrapper holds) under :func:`attention` when its
    attention is plain SDPA over full-attention layers and the speed machinery is on
    (:mod:`.speedups`). Returns whether it now does."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from . import speedups
    from .kv_cache import reserved_cache

    if not speedups.enabled():
        return False
    config = model_config(model)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation == ATTENTION:
        return True
    if implementation != "sdpa" or model in _NOT_PLAIN:
        return False
    kinds = {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")}
    if not kinds or not kinds <= set(PLAIN_ATTENTION) or reserved_cache(model, 1) is None:
        _NOT_PLAIN.add(model)
        return False
    AttentionInterface.register(ATTENTION, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    config._attn_implementation = ATTENTION
    return True


def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              shared_prefix: Any = None, packed_samples: list[list[tuple[int, ...]]] | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA, or the cascade (``shared_prefix``) or per-sample attention (``packed_samples``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from . import kv_cache

    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if shared_prefix is not None:
        layer = shared_prefix.layers[module.layer_idx]
        return kv_cache.cascade_attention(query, layer.prefix_keys, layer.prefix_values, key, value,
                                          shared_prefix.prompt_mask, layer.group, scale,
                                          getattr(shared_prefix, "own_mask", None)), None
    if packed_samples is not None and query.shape[-2] == key.shape[-2] and getattr(module, "is_causal", True):
        return per_sample_attention(query, key, value, packed_samples, scale, dropout), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def per_sample_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         samples: list[list[tuple[int, ...]]], scaling: float, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of packed rows (``query``: ``[rows, H, R, d]``, ``key`` / ``value``:
    ``[rows, H_kv, R, d]``) where row ``r`` holds the segments ``samples[r]`` back to back, covering the
    row: ``(start, length)``, a sample (or a shared prompt) attending inside itself; ``(start, length,
    prefix)``, a completion attending to the segment of index ``prefix`` of its row (its prompt, shared
    by the prompt's samples) and causally inside itself. Nothing else is attended to. Returns
    ``[rows, R, H, d]`` (the attention functions' layout)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    rows = []
    for r, row in enumerate(samples):
        # split, not slices: the backward of a split is one concatenation, a slice's a zeroed copy of
        # the whole row per sample
        sizes = [segment[1] for segment in row]
        qs, ks, vs = (t[r:r + 1].split(sizes, dim=2) for t in (query, key, value))
        parts = []
        for i, segment in enumerate(row):
            if len(segment) == 2:
                parts.append(F.scaled_dot_product_attention(qs[i], ks[i], vs[i], dropout_p=dropout, is_causal=True,
                                                            scale=scaling))
                continue
            j = segment[2]  # the prompt: all of it visible, then causal (the mask aligned bottom-right)
            parts.append(F.scaled_dot_product_attention(
                qs[i], torch.cat([ks[j], ks[i]], dim=2), torch.cat([vs[j], vs[i]], dim=2), dropout_p=dropout,
                attn_mask=causal_lower_right(sizes[i], sizes[j] + sizes[i]), scale=scaling))
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous()
