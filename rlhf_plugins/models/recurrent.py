"""Which models keep a recurrent state in some layers (Mamba, gated delta-net) instead of keys and
values: their state runs along the sequence, so a prompt cannot be encoded once and continued by each
of its samples, nor samples packed one after another into a row."""
from __future__ import annotations

import weakref
from typing import Any

_RECURRENT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def keeps_recurrent_state(model: Any) -> bool:
    """Whether a decoder layer of ``model`` carries a recurrent state: the layers transformers' cache
    keeps as linear-attention states (Granite 4.0-H's and Falcon-H1's Mamba-2, Qwen3-Next's gated
    delta-net). transformers' recurrent cache layers take no repeated batch (Falcon-H1: a
    convolution-state size error, Granite 4.0-H: no ``batch_repeat_interleave``)."""
    known = _RECURRENT.get(model)
    if known is None:
        known = _RECURRENT[model] = recurrent_config(_config_of(model))
    return known


def _config_of(model: Any) -> Any:
    """The transformers config of ``model`` or of the model a wrapper holds (a DeepSpeed engine's
    ``config`` is DeepSpeed's own; its model is ``module``)."""
    for candidate in (model, getattr(model, "module", None)):
        config = getattr(candidate, "config", None)
        if hasattr(config, "get_text_config"):
            return config
    return None


def recurrent_config(config: Any) -> bool:
    """:func:`keeps_recurrent_state` of the model a transformers ``config`` describes."""
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    layers = DynamicCache(config=config).layers if config is not None else []
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers)
