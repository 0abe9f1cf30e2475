"""Fixed-shape decode steps (what a CUDA graph replays on GPUs, rlhf_plugins/engines/static_decode.py)
sample exactly what the growing cache samples; here they run eagerly on the CPU."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_same_samples, speedups_supported

pytestmark = pytest.mark.skipif(not speedups_supported(), reason="the reserved KV caches are off here")


@pytest.fixture
def engine(tiny_model):
    from rlhf_plugins.api import prepare
    from rlhf_plugins.engines.transformers_engine import TransformersEngine
    from rlhf_plugins.testing import backend_context

    config, pm, _ = prepare({}, autoload=False)
    return TransformersEngine(backend_context(config, "generation", tiny_model, pm))


@pytest.mark.parametrize("shared", [False, True], ids=["reserved", "shared-prefix"])
def test_fixed_shape_steps_sample_what_the_growing_cache_samples(engine, shared, monkeypatch):
    """Ragged left-padded prompts (some of them past the shared-prefix width), n samples sharing a
    prefill, samples that stop early and samples that run to the budget: the same tokens, finish
    reasons and log-probs (float32 rounding) -- and the fixed-shape steps did run, every one of them
    handing attention the whole reserved storage."""
    from rlhf_plugins import SamplingParams
    from rlhf_plugins.engines import static_decode

    assert not engine.cuda_graphs  # no GPU here: the same steps, eagerly
    widths = []
    forward = static_decode.StaticDecode._forward

    def recorded(self):
        widths.append((self.cache.layers[0].keys.shape[-2], self.mask.shape[-1]))
        return forward(self)

    monkeypatch.setattr(static_decode.StaticDecode, "_forward", recorded)
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in (5, 40, 17, 33)]
    engine.shared_prefix = shared
    runs = {}
    for fixed in (True, False):
        engine.fixed_shapes = fixed
        runs[fixed] = [engine.generate(prompts, SamplingParams(n=n, max_new_tokens=b, temperature=1.3, seed=11))
                       for n, b in ((4, 40), (4, 3), (1, 12))]
        if fixed:
            steps = sum(max(map(len, r.completion_ids)) - 1 for r in runs[True])
            assert len(widths) == steps  # every decode step ran at the fixed shape
            # keys: the whole reservation at every step -- prompt (40) + budget, or the budget alone
            # (the samples' own part) where the prompts' part is shared (n > 1)
            assert all(keys == mask or (shared and keys == mask - 40) for keys, mask in widths)
            assert any(keys == mask - 40 for keys, mask in widths) == shared
    assert len(widths) == steps  # and the growing cache never did
    for fixed, growing in zip(runs[True], runs[False]):
        assert_same_samples(fixed, growing, atol=1e-5)
    assert "stop" in runs[True][0].finish_reasons and "length" in runs[True][1].finish_reasons


def test_the_fixed_shape_cache_writes_where_it_is_told_and_zeroes_the_rest():
    """fix_shapes: a layer hands back its whole reservation, the written position holds the new keys,
    the positions after the filled part are zero (masked attention multiplies them by 0: no NaN)."""
    from transformers.cache_utils import DynamicCache

    from rlhf_plugins.models.kv_cache import ReservedLayer, fix_shapes

    cache = DynamicCache()
    cache.layers = [ReservedLayer(6)]
    k = torch.randn(2, 1, 3, 4)
    cache.update(k, k + 1, 0)
    cache.layers[0]._keys[:, :, 3:] = float("nan")  # what uninitialised storage may hold
    at = torch.tensor([3])
    fix_shapes(cache, at, 3)
    new = torch.randn(2, 1, 1, 4)
    keys, values = cache.update(new, new - 1, 0)
    assert keys.shape == (2, 1, 6, 4) and torch.equal(keys[:, :, :3], k) and torch.equal(keys[:, :, 3:4], new)
    assert torch.equal(values[:, :, 3:4], new - 1) and not keys[:, :, 4:].any() and not values[:, :, 4:].any()
    at.fill_(5)
    keys, _ = cache.update(new * 2, new, 0)
    assert torch.equal(keys[:, :, 5:6], new * 2) and not keys[:, :, 4:5].any()
