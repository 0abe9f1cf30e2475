"""Which models keep a recurrent state in some layers (Mamba, gated delta-net) instead of keys and
values: their state runs along the sequence, so a prompt cannot be encoded once and continued by each
of its samples, nor samples packed one after another into a row."""
from __future__ import annotations

import weakref
from typing import Any

from .model_parts import model_config

_RECURRENT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def keeps_recurrent_state(model: Any) -> bool:
    """Whether a decoder layer of ``model`` carries a recurrent state: the layers transformers' cache
    keeps as linear-attention states (Granite 4.0-H's and Falcon-H1's Mamba-2, Qwen3-Next's gated
    delta-net). transformers' recurrent cache layers take no repeated batch (Falcon-H1: a
    convolution-state size error, Granite 4.0-H: no ``batch_repeat_interleave``)."""
    known = _RECURRENT.get(model)
    if known is None:
        known = _RECURRENT[model] = recurrent_config(model_config(model))
    return known


def recurrent_config(config: Any) -> bool:
    """:func:`keeps_recurrent_state` of the model a transformers ``config`` describes."""
    if config is None:
        return False
    from transformers import DynamicCache

    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:  # transformers 4.x: such models keep their state in a cache class of their own
        return any(key.startswith(RECURRENT_KEYS) for key in vars(config.get_text_config()))
    layers = DynamicCache(config=config).layers
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers)


#: on transformers 4.x (no recurrent cache layers to ask), the config keys of recurrent layers:
#: Mamba-2's (Granite 4.0-H, Falcon-H1, Bamba, Zamba 2), gated delta-net's (Qwen3-Next)
RECURRENT_KEYS = ("mamba_", "ssm_", "linear_conv_kernel_dim")
