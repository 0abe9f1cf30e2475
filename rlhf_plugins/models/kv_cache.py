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


def reserved_cache(model: Any, capacity: int) -> DynamicCache | None:
    """A cache whose full-attention layers reserve ``capacity`` positions, or None when the model's
    cache has other kinds of layers (sliding windows, linear attention) -- those keep transformers'
    own cache."""
    cache = DynamicCache(config=model.config)
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
