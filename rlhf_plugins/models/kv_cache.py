"""A KV cache for the transformers engine's sampling loop that reserves room for the whole
generation up front.

transformers' ``DynamicCache`` grows each layer by ``torch.cat`` every decode step, so step ``t``
copies the whole cache so far: at 64 sequences x 250 tokens x 8 layers that is hundreds of MB a
step, most of a realistic decode's memory traffic. Here each layer writes the new keys and values
into storage sized for prompt + budget and hands attention a view of the filled part: no copy per
step, the same attention inputs (values and shapes) as the dynamic cache.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .model_parts import model_config


def reserved_cache(model: Any, capacity: int) -> DynamicCache | None:
    """A cache whose full-attention layers reserve ``capacity`` positions, or None when the model's
    cache has other kinds of layers (sliding windows, linear attention) -- those keep transformers'
    own cache."""
    cache = DynamicCache(config=model_config(model))
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [ReservedLayer(capacity) for _ in cache.layers]
    return cache


class ReservedLayer(DynamicLayer):
    """A full-attention cache layer writing into storage for ``capacity`` positions; ``keys`` and
    ``values`` are views of the filled part (what ``DynamicLayer`` would hold after its cats)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        #: fixed-shape decoding (:func:`fix_shapes`): the position the next token is written at
        self.write_at: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, h, _, d = key_states.shape
        self._keys = key_states.new_empty((b, h, self.capacity, d))
        self._values = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]))
        self.length = 0

    def _views(self) -> None:
        self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.write_at is not None:
            return _write_at(self, key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"KV cache reserved for {self.capacity} positions, asked for {end}")
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:
            self._keys = self._keys.repeat_interleave(repeats, dim=0)
            self._values = self._values.repeat_interleave(repeats, dim=0)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self._views()

    def reset(self) -> None:
        self.length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the reserved KV cache is not cropped (the sampling loop never asks)")


def fix_shapes(cache: DynamicCache, write_at: torch.Tensor, filled: int) -> None:
    """Fixed-shape decoding over a reserved or shared-prefix cache whose first ``filled`` reserved
    positions hold keys: from now on each layer writes a step's keys and values at position
    ``write_at`` (a one-element device tensor the caller advances) and hands attention its whole
    reserved storage, the positions not yet written zeroed (attention masks them: ``-inf`` scores
    times zero values, never NaN garbage). Every decode step then has the same shapes and the same
    tensors, as a CUDA graph's replay needs."""
    for layer in cache.layers:
        if not isinstance(layer, (ReservedLayer, SharedPrefixLayer)):
            raise TypeError(f"fixed-shape decoding needs reserved cache layers, not {type(layer).__name__}")
        layer._keys[:, :, filled:].zero_()
        layer._values[:, :, filled:].zero_()
        layer.keys, layer.values, layer.write_at = layer._keys, layer._values, write_at


def _write_at(layer: ReservedLayer | SharedPrefixLayer, key_states: torch.Tensor,
              value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    layer._keys.index_copy_(2, layer.write_at, key_states)
    layer._values.index_copy_(2, layer.write_at, value_states)
    return layer._keys, layer._values


# --- shared-prefix (cascade) attention for the decode steps ---------------------------------------
#: prompts narrower than this decode faster with SDPA over the repeated prefix (measured per layer and
#: step, 16 prompts x 8 samples: 12-token prompts 313 us SDPA vs 422 us cascade, 40 tokens 450 vs 409)
SHARED_PREFIX_MIN_PROMPT = 32


def shared_prefix_cache(model: Any, prompt_mask: torch.Tensor, budget: int) -> DynamicCache:
    """A cache that keeps each prompt's keys and values once (``[prompts, heads, P, d]``) and the
    samples' own tokens in storage reserved for ``budget`` per sample. Decode steps pass it as
    ``shared_prefix=`` to a model enabled by :func:`rlhf_plugins.models.attention.enable`."""
    cache = DynamicCache(config=model.config)
    cache.layers = [SharedPrefixLayer(budget) for _ in cache.layers]
    cache.prompt_mask = prompt_mask.bool()
    return cache


class SharedPrefixLayer(DynamicLayer):
    """The prompts' keys and values from the prefill, shared by the ``group`` samples of each
    prompt once ``batch_repeat_interleave(group)`` is called, plus each sample's decoded tokens."""

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget, self.group, self.prefix_length, self.length = budget, 1, 0, 0
        self.write_at: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:  # the prefill: the prompts themselves
            self.lazy_initialization(key_states, value_states)
            # contiguous once, so that no decode step copies them for its matrix products
            self.prefix_keys, self.prefix_values = key_states.contiguous(), value_states.contiguous()
            self.keys, self.values, self.prefix_length = key_states, value_states, key_states.shape[-2]
            return key_states, value_states
        if self.write_at is not None:
            return _write_at(self, key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self.group == 1 or end > self.budget:
            raise ValueError(f"shared-prefix KV cache: {end} decoded positions of {self.budget} reserved, "
                             f"group {self.group} (batch_repeat_interleave first)")
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each prompt now has ``repeats`` samples: reserve their own storage, share the prefix."""
        u, h, _, d = self.prefix_keys.shape
        self.group = repeats
        self._keys = self.prefix_keys.new_empty((u * repeats, h, self.budget, d))
        self._values = self.prefix_values.new_empty((u * repeats, h, self.budget, self.prefix_values.shape[-1]))
        self.length = 0

    def get_seq_length(self) -> int:
        return self.prefix_length + self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("the shared-prefix KV cache keeps whole groups (the sampling loop never selects)")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the shared-prefix KV cache is not cropped (the sampling loop never asks)")


def cascade_attention(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, own_k: torch.Tensor,
                      own_v: torch.Tensor, prompt_mask: torch.Tensor, group: int, scaling: float,
                      own_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sample (``q``: ``[B, H, 1, d]``, samples grouped by prompt,
    ``group`` each) over its prompt's keys (``[B / group, H_kv, P, d]``, ``prompt_mask`` 1 on real
    tokens) and its own (``[B, H_kv, T, d]``; ``own_mask`` ``[B, T]``, when given, True where written),
    as ``[B, 1, H, d]`` (the attention functions' layout)."""
    B, H, L, d = q.shape
    U, Hkv, P, _ = prefix_k.shape
    rep, T = H // Hkv, own_k.shape[-2]
    if L != 1:
        raise ValueError(f"cascade attention takes one new token per sample, got {L}")
    # the prompt's part: its samples' queries (x the heads sharing a KV head) in one matrix product
    qg = q.reshape(U, group, Hkv, rep, d).transpose(1, 2).reshape(U, Hkv, group * rep, d)
    scores_p = torch.matmul(qg, prefix_k.transpose(-1, -2)).mul_(scaling)
    scores_p.masked_fill_(~prompt_mask[:, None, None, :], float("-inf"))
    scores_p = scores_p.view(U, Hkv, group, rep, P).transpose(1, 2).reshape(B, H, P)
    scores_o = torch.matmul(q.reshape(B, Hkv, rep, d), own_k.transpose(-1, -2)).mul_(scaling).view(B, H, T)
    if own_mask is not None:
        scores_o.masked_fill_(~own_mask[:, None, :], float("-inf"))
    probs = torch.softmax(torch.cat([scores_p, scores_o], dim=-1), dim=-1,
                          dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    probs_p = probs[..., :P].reshape(U, group, Hkv, rep, P).transpose(1, 2).reshape(U, Hkv, group * rep, P)
    out = torch.matmul(probs_p, prefix_v).view(U, Hkv, group, rep, d).transpose(1, 2).reshape(B, H, d)
    out = out + torch.matmul(probs[..., P:].reshape(B, Hkv, rep, T), own_v).view(B, H, d)
    return out.view(B, 1, H, d)
