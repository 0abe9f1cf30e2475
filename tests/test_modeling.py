"""The shared-prefix forward gives the same log-probs and gradients as a plain forward."""
from __future__ import annotations

import pytest
import torch

from rlhf_plugins.models.forward import group_permutation, policy_forward, split_batch
from tests.helpers import random_batch


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefix_matches_plain_forward(model, temperature):
    batch = random_batch()
    plain = dict(batch, group_size=1)
    mask = batch["action_mask"].bool()
    model.zero_grad()
    a = policy_forward(model, batch, temperature, with_entropy=True)
    (a["logprobs"] * batch["action_mask"]).sum().backward()
    grads_a = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    b = policy_forward(model, plain, temperature, with_entropy=True)
    (b["logprobs"] * batch["action_mask"]).sum().backward()
    grads_b = [p.grad.clone() for p in model.parameters()]
    assert (a["logprobs"] - b["logprobs"]).abs()[mask].max() < 1e-5
    assert (a["entropy"] - b["entropy"]).abs()[mask].max() < 1e-4
    for ga, gb in zip(grads_a, grads_b):
        assert (ga - gb).abs().max() <= 1e-5 * gb.abs().max() + 1e-7  # float32 summation order only


def test_misaligned_micro_batches_fall_back_to_plain(model):
    batch = random_batch(group=4, prompts=3)
    full = policy_forward(model, dict(batch, group_size=1))["logprobs"]
    parts = split_batch(batch, 5)
    assert [p["group_size"] for p in parts] == [1, 1, 1]
    joined = torch.cat([policy_forward(model, p)["logprobs"] for p in parts])
    assert (joined - full).abs()[batch["action_mask"].bool()].max() < 1e-5
    aligned = split_batch(batch, 8)
    assert [p["group_size"] for p in aligned] == [4, 4]


def test_group_permutation_keeps_groups_together():
    order = group_permutation(12, 4, torch.Generator().manual_seed(0)).tolist()
    assert sorted(order) == list(range(12))
    for i in range(0, 12, 4):
        block = order[i : i + 4]
        assert block == list(range(block[0], block[0] + 4)) and block[0] % 4 == 0


def test_reserved_kv_cache_samples_exactly_what_the_growing_cache_samples(tiny_model, monkeypatch):
    """The engine's reserved cache (no per-step concatenation) gives the same tokens and log-probs as
    transformers' DynamicCache: ragged left-padded prompts, n samples sharing a prefill, samples that
    stop early and samples that run to the budget."""
    from rlhf_plugins import SamplingParams
    from rlhf_plugins.api import prepare
    from rlhf_plugins.engines import transformers_engine
    from rlhf_plugins.engines.transformers_engine import TransformersEngine
    from rlhf_plugins.testing import backend_context

    config, pm, _ = prepare({}, autoload=False)
    engine = TransformersEngine(backend_context(config, "generation", tiny_model, pm))
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in (5, 17, 9, 30)]
    budgets = (4, 40)
    reserved = [engine.generate(prompts, SamplingParams(n=3, max_new_tokens=b, temperature=1.3, seed=11))
                for b in budgets]
    monkeypatch.setattr(transformers_engine, "reserved_cache", lambda model, capacity: None)
    growing = [engine.generate(prompts, SamplingParams(n=3, max_new_tokens=b, temperature=1.3, seed=11))
               for b in budgets]
    for r, d in zip(reserved, growing):
        assert r.completion_ids == d.completion_ids
        assert r.logprobs == d.logprobs
        assert r.finish_reasons == d.finish_reasons
    assert "length" in reserved[0].finish_reasons and "stop" in reserved[1].finish_reasons
    assert max(map(len, reserved[1].completion_ids)) > 4  # decoding went on past the short budget


def test_reserved_kv_cache_is_used_only_for_full_attention_models():
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from rlhf_plugins.models.kv_cache import ReservedLayer, reserved_cache

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2)
    llama = reserved_cache(LlamaForCausalLM(LlamaConfig(**small)), 40)
    assert [type(layer) for layer in llama.layers] == [ReservedLayer, ReservedLayer]
    assert reserved_cache(MistralForCausalLM(MistralConfig(sliding_window=8, **small)), 40) is None
    layer = llama.layers[0]
    k = torch.randn(1, 2, 30, 16)
    layer.update(k, k)
    with pytest.raises(ValueError, match="reserved for 40 positions, asked for 41"):
        layer.update(torch.randn(1, 2, 11, 16), torch.randn(1, 2, 11, 16))
