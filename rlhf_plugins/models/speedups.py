"""The one switch over the speed machinery that reaches into transformers' internals: the reserved
and shared-prefix KV caches (:mod:`.kv_cache`, subclasses of transformers' cache layers) and the
cascade / per-sample attention (:mod:`.attention`, registered through its attention interface).

They are used when transformers' internals are what they were written against -- checked once per
process by running a cache layer through an update, as the engine does -- and when
``RLHF_SPEEDUPS`` is not turned off. Otherwise transformers' own cache and attention run (the same
results, more memory traffic per decode step and per packed row), with one line saying why.
Process-wide allocator tuning is a separate matter (:mod:`rlhf_plugins.training.host_memory`).
"""
from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger("rlhf_plugins")

#: ``RLHF_SPEEDUPS=0`` (or false / no / off) runs transformers' own cache and attention
ENV = "RLHF_SPEEDUPS"


def enabled() -> bool:
    """Whether the KV caches and attention of this package run (else transformers' own)."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return supported()


@functools.cache
def supported() -> bool:
    """transformers' cache layers and attention registry behave as the speed machinery expects."""
    import transformers

    try:
        problem = _probe()
    except Exception as exc:  # noqa: BLE001 - any difference in internals means: do not use them
        problem = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if problem:
        logger.warning("transformers %s: %s; its own KV cache and attention run instead (same results, slower "
                       "decoding on CPUs; %s=0 silences this)", transformers.__version__, problem, ENV)
    return not problem


def _probe() -> str:
    """What differs from the internals the machinery subclasses, or '' when nothing does."""
    import torch
    from transformers import AttentionInterface  # noqa: F401  (the registry the attention joins)
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask  # noqa: F401

    from .kv_cache import ReservedLayer, SharedPrefixLayer

    k = torch.arange(8.0).view(1, 1, 2, 4)
    cache = DynamicCache()
    cache.layers = [ReservedLayer(3)]
    keys, values = cache.update(k, k + 1, 0)
    keys, values = cache.update(k[:, :, :1], k[:, :, :1], 0)
    if keys.shape != (1, 1, 3, 4) or not torch.equal(keys[:, :, :2], k) or cache.get_seq_length() != 3:
        return "its cache layers do not store keys as a DynamicLayer does"
    prefix = DynamicCache()
    prefix.layers = [SharedPrefixLayer(2)]
    prefix.update(k, k, 0)  # the prefill: one prompt of two tokens
    prefix.batch_repeat_interleave(2)
    own = torch.ones(2, 1, 1, 4)
    keys, _ = prefix.update(own, own, 0)
    if keys.shape != (2, 1, 1, 4) or prefix.get_seq_length() != 3:
        return "its cache does not hand its layers a repeated batch as expected"
    return ""
