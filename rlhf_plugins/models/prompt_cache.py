"""The KV caches of the learner's shared-prompt forward (:func:`.forward.completion_logits`), written so
that activation checkpointing can recompute any decoder layer.

A GRPO batch holds each prompt once per sample of its group; the forward encodes each prompt once
and its samples' completions attend to its keys and values, repeated for the group. transformers'
dynamic cache grows by concatenation on every update, so a layer run a second time -- which is what
activation checkpointing does in the backward pass -- would append its keys again; transformers
therefore drops the cache of a checkpointed layer, and the shared forward used to be switched off under
``--learner.gradient_checkpointing`` (the real-model default), every sample then running its prompt.

Here the prompt's forward writes each layer's keys and values once (a recomputation gets back what it
computed, nothing stored), and the completions' forward reads another cache holding them: each update
returns the prompt's keys, repeated for its group, followed by the completion's own, and stores
nothing. Both are idempotent, so a decoder layer may be recomputed any number of times, in any order;
gradients reach the prompt's layers through the repeated keys and values. Both caches are updated
outside compiled code (``--learner.compile_scope layers``): inside a graph the update would tie the
compiled code to the layer's index and the cache's state.

Used where every layer's cache is transformers' plain :class:`DynamicLayer` (full attention; a
sliding window keeps transformers' cache) and the speed machinery is on (:mod:`.speedups`).
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .model_parts import model_config

#: transformers' flag of a checkpointed decoder layer that keeps the cache it is given
KEEP = "_can_checkpoint_with_cache"


class PromptCache(DynamicCache):
    """The shared prompt's KV cache: written once per layer by the prompt's forward, then read by the
    completions' forward through :meth:`reader`."""

    @torch.compiler.disable
    def update(self, *args: Any, **kwargs: Any) -> Any:
        return super().update(*args, **kwargs)

    def written(self) -> bool:
        """Whether the prompt's forward wrote every layer (a model that ignored the cache did not)."""
        return bool(self.layers) and all(layer.is_initialized for layer in self.layers)

    def reader(self, group: int) -> PromptCache:
        """The completions' cache: each layer's prompt keys and values, read for the ``group`` samples of
        each prompt (consecutive in the batch) and never extended."""
        out = copy.copy(self)
        out.layers = [_ReadLayer(layer.keys, layer.values, group) for layer in self.layers]
        return out


class _WriteOnceLayer(DynamicLayer):
    """Stores its first keys and values; a recomputation gets what it computed back, nothing stored."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _ReadLayer(DynamicLayer):
    """The prompt's keys and values, each repeated for its ``group`` samples and followed by the caller's
    own, on every update; never extended. The repetition is made inside the update, so that it lives
    only as long as the attention that reads it (a checkpointed layer makes it again when recomputed):
    kept between the forward and the backward pass, a group's copies of its prompt's keys and values
    would take more memory than the prompt's own activations for a model without grouped-query
    attention."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, group: int) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.group = keys, values, group

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.cat([self.keys.repeat_interleave(self.group, dim=0), key_states], dim=-2),
                torch.cat([self.values.repeat_interleave(self.group, dim=0), value_states], dim=-2))


def prompt_cache(model: Any) -> PromptCache | None:
    """An empty :class:`PromptCache` for ``model`` (or the model a PEFT / DeepSpeed wrapper holds), or
    None where its layers' caches are not plain full attention or the speed machinery is off."""
    from . import speedups

    config = model_config(model)
    if config is None or not speedups.enabled():
        return None
    try:
        cache = PromptCache(config=config)
    except Exception:  # noqa: BLE001 - a config transformers' cache cannot read: its own cache then
        return None
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [_WriteOnceLayer() for _ in cache.layers]
    return cache


def checkpointed_layers(model: Any) -> list[torch.nn.Module] | None:
    """The decoder layers transformers checkpoints (its ``GradientCheckpointingLayer``), when it can be
    told to keep their cache under checkpointing (``_can_checkpoint_with_cache``); else None."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    if not hasattr(GradientCheckpointingLayer, KEEP):
        return None
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return layers or None


@contextmanager
def cache_kept(layers: list[torch.nn.Module]) -> Iterator[None]:
    """Checkpointed ``layers`` keep the cache they are given (transformers drops it from a checkpointed
    layer, whose update it assumes appends): for the caches of this module, whose updates may repeat."""
    own = [layer.__dict__.get(KEEP) for layer in layers]  # an instance's own setting, restored after
    for layer in layers:
        setattr(layer, KEEP, True)
    try:
        yield
    finally:
        for layer, before in zip(layers, own):
            if before is None:
                delattr(layer, KEEP)
            else:
                setattr(layer, KEEP, before)
