"""The shared-prefix forward gives the same log-probs and gradients as a plain forward."""
from __future__ import annotations

import pytest
import torch

from rlhf_plugins.models.forward import group_permutation, policy_forward, split_batch
from tests.helpers import assert_same_samples, random_batch, speedups_supported

#: tests of the package's own KV caches and attention, which transformers 4.x does not run
needs_speedups = pytest.mark.skipif(not speedups_supported(), reason="this transformers runs its own cache and "
                                    "attention (rlhf_plugins.models.speedups)")


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


def _checkpointed_run(path: str, batch: dict, checkpointing: bool) -> dict:
    """One forward and backward of ``batch`` through a fresh float64 copy of the model at ``path``: the
    log-probs, the gradients, the token widths its embedding saw and how often layer 1's attention ran."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).train()
    if checkpointing:
        from rlhf_plugins.models.hf_names import enable_checkpointing

        enable_checkpointing(model)
    widths, attention_calls = [], []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: widths.append(tuple(args[0].shape)))
    attention = model.model.layers[1].self_attn
    forward = attention.forward
    attention.forward = lambda *a, **k: attention_calls.append(1) or forward(*a, **k)
    logprobs = policy_forward(model, batch, logits_memory_mb=0)["logprobs"]
    (logprobs * batch["action_mask"]).sum().backward()
    kept = [layer for layer in model.model.layers if "_can_checkpoint_with_cache" in vars(layer)]
    return {"logprobs": logprobs.detach(), "grads": {n: p.grad for n, p in model.named_parameters()},
            "widths": widths, "attention_calls": len(attention_calls), "kept": kept}


@needs_speedups
@pytest.mark.parametrize("shape", ["tiny", "qwen2.5-0.5b"])
def test_checkpointed_layers_encode_each_prompt_once_with_the_gradients_of_the_plain_forward(tiny_model, shape):
    """Under activation checkpointing (the real-model default) the prompt is still encoded once per
    group: each layer's recomputation in the backward pass writes nothing more to the prompt's cache
    and reads it as the forward did, so the log-probs and gradients are those without checkpointing
    (the same operations) and those of every sample run whole (float32 norms inside: 1e-6)."""
    from rlhf_plugins.testing import reduced_model_path

    path = tiny_model if shape == "tiny" else reduced_model_path(shape, layers=3, hidden=128)
    batch = random_batch(group=4, prompts=3, seed=3)
    P, T = batch["prompt_width"], batch["action_mask"].shape[1]
    shared = _checkpointed_run(path, batch, checkpointing=True)
    assert shared["widths"] == [(3, P), (12, T - 1)]  # each prompt once, then the completions
    assert shared["attention_calls"] == 4  # the prompt's and the completions' forwards, each recomputed
    assert shared["kept"] == []  # transformers' flag back as it was
    unchecked = _checkpointed_run(path, batch, checkpointing=False)
    assert unchecked["widths"] == shared["widths"] and unchecked["attention_calls"] == 2
    whole = _checkpointed_run(path, dict(batch, group_size=1), checkpointing=True)
    assert whole["widths"] == [(12, P + T)]
    mask = batch["action_mask"].bool()
    torch.testing.assert_close(shared["logprobs"], unchecked["logprobs"], rtol=0, atol=1e-12)
    assert (shared["logprobs"] - whole["logprobs"]).abs()[mask].max() < 1e-9
    for name, grad in whole["grads"].items():
        torch.testing.assert_close(shared["grads"][name], unchecked["grads"][name], rtol=0, atol=1e-12)
        assert (shared["grads"][name] - grad).abs().max() <= 1e-6 * grad.abs().max(), name


@needs_speedups
def test_a_checkpointed_critic_encodes_each_prompt_once_with_the_values_of_the_plain_forward(tiny_model):
    """The critic (a backbone and a value head) keeps its shared prompts under checkpointing too: its
    backbone sees each prompt once, and its values and gradients are those of every sample run whole."""
    from rlhf_plugins.models.forward import value_forward
    from rlhf_plugins.models.value_model import ValueModel

    batch = random_batch(group=4, prompts=3, seed=4)
    runs = {}
    for shared in (True, False):
        critic = ValueModel.from_pretrained(tiny_model, torch.float64).train()
        torch.manual_seed(0)
        torch.nn.init.normal_(critic.value_head.weight)  # a fresh head is zero: no gradient reaches the backbone
        critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        widths: list[tuple[int, ...]] = []
        critic.backbone.get_input_embeddings().register_forward_hook(
            lambda m, a, o, seen=widths: seen.append(tuple(a[0].shape)))
        values = value_forward(critic, batch if shared else dict(batch, group_size=1))["values"]
        (values * batch["action_mask"]).sum().backward()
        runs[shared] = (values.detach(), {n: p.grad for n, p in critic.named_parameters()}, widths)
    assert runs[True][2] == [(3, batch["prompt_width"]), (12, batch["action_mask"].shape[1] - 1)]
    assert runs[False][2] == [tuple(batch["sequences"].shape)]
    mask = batch["action_mask"].bool()
    assert (runs[True][0] - runs[False][0]).abs()[mask].max() < 1e-9
    for name, grad in runs[False][1].items():
        assert (runs[True][1][name] - grad).abs().max() <= 1e-6 * grad.abs().max(), name


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
    engine.shared_prefix = False  # the per-sample reserved cache (the cascade is tested below)
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


@needs_speedups
def test_shared_prefix_decoding_samples_what_per_sample_attention_samples(tiny_model, monkeypatch):
    """Cascade attention in decode (each prompt's keys read once for its samples) against the
    reserved per-sample cache under SDPA: same tokens, log-probs equal to float32 rounding, on
    ragged left-padded prompts, early-stopping and budget-length samples; n = 1 keeps SDPA. The
    cascade runs (its decode steps are counted) only for prompts of SHARED_PREFIX_MIN_PROMPT or more."""
    from rlhf_plugins import SamplingParams
    from rlhf_plugins.api import prepare
    from rlhf_plugins.engines.transformers_engine import TransformersEngine
    from rlhf_plugins.models import attention, kv_cache
    from rlhf_plugins.testing import backend_context

    calls = []
    cascade = kv_cache.cascade_attention
    monkeypatch.setattr(kv_cache, "cascade_attention", lambda *a: calls.append(a[0].shape[0]) or cascade(*a))
    config, pm, _ = prepare({}, autoload=False)
    engine = TransformersEngine(backend_context(config, "generation", tiny_model, pm))
    assert engine.shared_prefix and engine.model.config._attn_implementation == attention.ATTENTION
    layers = engine.model.config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in (5, 40, 17, 33)]
    runs, counted = {}, []
    for shared in (True, False):
        engine.shared_prefix = shared
        runs[shared] = []
        for n, budget in ((4, 40), (4, 2), (1, 12)):
            calls.clear()
            runs[shared].append(engine.generate(prompts, SamplingParams(n=n, max_new_tokens=budget, temperature=1.3,
                                                                        seed=11)))
            counted.append(list(calls))
    # every decode step of every layer (one fewer than the longest completion) ran the cascade on 16
    # samples when sharing and n > 1; never under SDPA or for n = 1
    longest = [max(map(len, r.completion_ids)) for r in runs[True][:2]]
    assert counted[:2] == [[16] * (layers * (m - 1)) for m in longest]
    assert counted[2:] == [[]] * 4
    short = [p[:20] for p in prompts]  # narrower than SHARED_PREFIX_MIN_PROMPT: SDPA is faster there
    engine.shared_prefix = True
    calls.clear()
    engine.generate(short, SamplingParams(n=4, max_new_tokens=8, seed=11))
    assert calls == []
    for cascade, plain in zip(runs[True], runs[False]):
        assert_same_samples(cascade, plain, atol=1e-5)
    assert "stop" in runs[True][0].finish_reasons and "length" in runs[True][1].finish_reasons
    assert max(map(len, runs[True][0].completion_ids)) > 2  # decoding went on past the short budget


@needs_speedups
def test_a_mixture_of_experts_decodes_its_shared_prefixes_as_per_sample_attention_does(monkeypatch):
    """Qwen3-MoE's attention is plain SDPA (as Qwen2-MoE's and Mixtral's): the engine decodes each prompt's
    keys once for its samples (the cascade's calls counted), sampling what per-sample attention samples, on
    a reduced Qwen3-30B-A3B (128 experts, 8 per token, Qwen2.5's vocabulary)."""
    from rlhf_plugins import SamplingParams
    from rlhf_plugins.api import prepare
    from rlhf_plugins.engines.transformers_engine import TransformersEngine
    from rlhf_plugins.models import kv_cache
    from rlhf_plugins.testing import backend_context, reduced_model_path

    calls = []
    cascade = kv_cache.cascade_attention
    monkeypatch.setattr(kv_cache, "cascade_attention", lambda *a: calls.append(a[0].shape[0]) or cascade(*a))
    path = reduced_model_path("qwen3-30b-a3b", layers=2, hidden=64)
    config, pm, _ = prepare({}, autoload=False)
    engine = TransformersEngine(backend_context(config, "generation", path, pm))
    assert engine.shared_prefix
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 5000, (int(n),), generator=g).tolist() for n in (40, 33)]
    runs = {}
    for shared in (True, False):
        engine.shared_prefix = shared
        calls.clear()
        runs[shared] = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=6, temperature=1.3, seed=11))
        assert bool(calls) == shared and all(c == 8 for c in calls)
    assert_same_samples(runs[True], runs[False], atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cascade_attention_equals_sdpa_over_the_whole_sequence(kv_heads):
    """Against torch's SDPA on the repeated prompt + own keys (grouped-query heads expanded as
    transformers does), float64, left-padded prompts."""
    from rlhf_plugins.models.kv_cache import cascade_attention

    g = torch.Generator().manual_seed(0)
    U, group, H, P, T, d = 3, 4, 4, 7, 5, 8
    B = U * group
    q = torch.randn(B, H, 1, d, generator=g, dtype=torch.float64)
    pk, pv = (torch.randn(U, kv_heads, P, d, generator=g, dtype=torch.float64) for _ in range(2))
    ok, ov = (torch.randn(B, kv_heads, T, d, generator=g, dtype=torch.float64) for _ in range(2))
    prompt_mask = torch.ones(U, P, dtype=torch.bool)
    prompt_mask[0, :3] = False
    prompt_mask[2, :1] = False
    got = cascade_attention(q, pk, pv, ok, ov, prompt_mask, group, d**-0.5)
    k = torch.cat([pk.repeat_interleave(group, 0), ok], dim=2).repeat_interleave(H // kv_heads, dim=1)
    v = torch.cat([pv.repeat_interleave(group, 0), ov], dim=2).repeat_interleave(H // kv_heads, dim=1)
    mask = torch.cat([prompt_mask.repeat_interleave(group, 0), torch.ones(B, T, dtype=torch.bool)], 1)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=1e-12)


@needs_speedups
def test_shared_prefix_attention_only_for_plain_sdpa_full_attention_models():
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from rlhf_plugins.models.attention import enable
    from rlhf_plugins.models.kv_cache import shared_prefix_cache

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2)
    assert enable(LlamaForCausalLM(LlamaConfig(**small)))
    assert not enable(LlamaForCausalLM(LlamaConfig(attn_implementation="eager", **small)))
    assert not enable(MistralForCausalLM(MistralConfig(sliding_window=8, **small)))
    layer = shared_prefix_cache(LlamaForCausalLM(LlamaConfig(**small)), torch.ones(1, 6), 3).layers[0]
    layer.update(torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16))
    with pytest.raises(ValueError, match="batch_repeat_interleave first"):
        layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    layer.batch_repeat_interleave(2)
    for _ in range(3):
        layer.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16))
    assert layer.get_seq_length() == 9
    with pytest.raises(ValueError, match="4 decoded positions of 3 reserved"):
        layer.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16))


@needs_speedups
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


_FAULTS = """
import json, resource, sys
import torch
from rlhf_plugins.config.schema import Config
from rlhf_plugins.training import host_memory

config = Config()
config.train.reuse_freed_memory = {"on": True, "off": False}.get(sys.argv[1])  # else empty: the default
if sys.argv[1] == "default-owned":
    host_memory.claim_process()
host_memory.apply(config)

def faults_of_a_64mb_activation():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 * 2**20)  # 64 MB, written through (as an activation is)
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

first = faults_of_a_64mb_activation()
print(json.dumps({"applied": host_memory._applied, "first": first,
                  "again": [faults_of_a_64mb_activation() for _ in range(6)]}))
"""


def _faults(setting: str, **env: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_",
                                                               "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", _FAULTS, setting], env={**clean, **env}, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_reuse_freed_memory_serves_the_next_activation_without_page_faults():
    """A 64 MB tensor is 16384 pages: by default glibc maps it afresh each time (every page faulted
    in and zeroed again); with train.reuse_freed_memory later ones reuse freed pages (glibc may place a
    small allocation in a freed block first, so not every time: at least half of them)."""
    from rlhf_plugins.training.host_memory import glibc

    if glibc() is None:
        pytest.skip("the setting applies to glibc's malloc only")
    on, off = _faults("on"), _faults("off")
    assert on["applied"] is True and off["applied"] is None
    assert off["first"] > 10_000 and min(off["again"]) > 10_000  # mapped and faulted in every time
    assert on["first"] > 10_000  # faulted once, then mostly reused
    assert sum(on["again"]) <= 0.5 * sum(off["again"]) and min(on["again"]) < 500


def test_reuse_freed_memory_is_on_by_default_only_in_processes_this_project_owns():
    """The `rlhf` command and Ray role actors claim their process; a program calling api.train keeps
    its own malloc unless it sets train.reuse_freed_memory."""
    from rlhf_plugins.training.host_memory import glibc

    if glibc() is None:
        pytest.skip("the setting applies to glibc's malloc only")
    assert _faults("default")["applied"] is None
    owned = _faults("default-owned")
    assert owned["applied"] is True and min(owned["again"]) < 500


_RELEASED = """
import json, sys, psutil, torch
import rlhf_plugins.config.scale as scale
from rlhf_plugins.config.schema import Config
from rlhf_plugins.testing import reduced_model_path
from rlhf_plugins.training import host_memory

config = Config()
config.model.path = reduced_model_path()
scale.REAL_MODEL_PARAMETERS = 10_000_000 if sys.argv[1] == "real" else 10**12
host_memory.claim_process()
host_memory.apply(config)
rss = lambda: psutil.Process().memory_info().rss / 2**20
base = rss()
x = torch.ones(8 * 2**20)  # 32 MB, freed: glibc then raises its mmap threshold to 32 MB
del x
kept = []
for _ in range(3):
    y = torch.ones(4 * 2**20)  # 16 MB: from the heap under glibc's raised threshold, mapped on its own if released
    del y
    kept.append(rss() - base)
print(json.dumps({"released": host_memory._released, "reused": host_memory._applied, "kept_mb": kept}))
"""


def test_a_real_models_roles_hand_freed_tensors_back_at_once():
    """In a process this project owns, a real-size model's roles map every large allocation on its own
    and unmap it when freed (resident memory tracks what is live); the tiny default keeps reusing it."""
    import json
    import subprocess
    import sys

    from rlhf_plugins.training.host_memory import glibc

    if glibc() is None:
        pytest.skip("the setting applies to glibc's malloc only")
    runs = {}
    for kind in ("real", "tiny"):
        out = subprocess.run([sys.executable, "-c", _RELEASED, kind], capture_output=True, text=True, check=True)
        runs[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["real"]["released"] is True and runs["real"]["reused"] is None
    assert max(runs["real"]["kept_mb"]) < 4  # each 16 MB block went back when freed
    assert runs["tiny"]["reused"] is True and runs["tiny"]["released"] is False
    assert min(runs["tiny"]["kept_mb"]) > 12  # kept for the next one


def test_reuse_freed_memory_leaves_a_users_own_malloc_tuning_alone():
    from rlhf_plugins.training.host_memory import glibc

    if glibc() is None:
        pytest.skip("the setting applies to glibc's malloc only")
    tuned = _faults("on", MALLOC_MMAP_THRESHOLD_="1048576")
    assert tuned["applied"] is False
    assert min(tuned["again"]) > 10_000  # the user's threshold (1 MB) still maps a 64 MB tensor afresh
    assert _faults("on", GLIBC_TUNABLES="glibc.malloc.mmap_max=65536")["applied"] is False
    assert _faults("on", GLIBC_TUNABLES="glibc.cpu.x86_shstk=off")["applied"] is True  # not malloc's


_RETURNED = """
import json, resource, psutil, torch
from rlhf_plugins.training import host_memory

assert host_memory.reuse_freed_memory()
rss = lambda: psutil.Process().memory_info().rss / 2**20
x = torch.ones(128 * 2**20)  # 512 MB, then freed: kept for reuse
del x
kept = rss()
with host_memory.returned_to_the_system():
    inside = rss()
    y = torch.ones(192 * 2**20)  # 768 MB: more than the heap holds free, so mapped for itself
    del y
    inside_freed = rss()  # ... and unmapped when freed
y = torch.ones(192 * 2**20)  # after the block: taken from the heap and kept when freed
del y
after_freed = rss()
faults = []
for _ in range(4):  # and reused without faulting pages in again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    w = torch.ones(16 * 2**20)
    del w
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "inside": inside, "inside_freed": inside_freed, "after_freed": after_freed,
                  "after": faults}))
"""


def test_memory_kept_for_reuse_goes_back_before_vllm_sizes_its_cache():
    """vLLM on the CPU gives its KV cache a share of the node minus this process's RSS: inside
    returned_to_the_system() the memory kept for reuse is handed back and glibc's defaults hold;
    after it, freed memory is kept for reuse again."""
    import json
    import subprocess
    import sys

    from rlhf_plugins.training.host_memory import glibc

    if glibc() is None:
        pytest.skip("the setting applies to glibc's malloc only")
    out = json.loads(subprocess.run([sys.executable, "-c", _RETURNED], capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()[-1])
    assert out["kept"] - out["inside"] > 400  # MB handed back of the 512 freed
    assert out["inside_freed"] - out["inside"] < 100  # glibc's defaults inside: the 768 MB went back
    assert out["after_freed"] - out["inside"] > 700  # kept for reuse again after the block
    assert min(out["after"]) < 500  # ... and reused


_SAVES = """
import json, sys
import accelerate.utils.other as unwrapping
from transformers import AutoModelForCausalLM
from rlhf_plugins.models.folder import save_pretrained
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
save_pretrained(model, sys.argv[2] + "/ours")
ours = "deepspeed" in sys.modules
model.save_pretrained(sys.argv[2] + "/plain")
print(json.dumps({"ours": ours, "plain": "deepspeed" in sys.modules, "probe": unwrapping.is_deepspeed_available()}))
"""


def test_saving_a_model_imports_deepspeed_only_in_a_process_that_has(tiny_model, tmp_path):
    """transformers' save_pretrained has accelerate import DeepSpeed (1.5-2 s) to check whether the
    model is a DeepSpeed engine; ours skips that check where DeepSpeed was never imported, writes
    the same folder, and leaves accelerate's check as it was."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.helpers import clean_env

    out = json.loads(subprocess.run([sys.executable, "-c", _SAVES, tiny_model, str(tmp_path)], capture_output=True,
                                    text=True, check=True, env=clean_env()).stdout.strip().splitlines()[-1])
    assert out == {"ours": False, "plain": True, "probe": True}
    ours, plain = tmp_path / "ours", tmp_path / "plain"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in plain.iterdir())
    a, b = load_file(ours / "model.safetensors"), load_file(plain / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


_DEEPSPEED_RUN = """
import json, sys
from rlhf_plugins.cli import main
code = main(["train", "--learner.backend", "deepspeed", "--train.steps", "1", "--train.prompts_per_step", "2",
             "--generation.n_samples_per_prompt", "2", "--eval.enabled", "false", "--train.progress", "false"])
from deepspeed.autotuning import autotuner
loaded = "mlflow" in sys.modules
import mlflow
print(json.dumps({"code": code, "loaded": loaded, "autotuner": autotuner.has_mlflow, "later": mlflow.__name__}))
"""


def test_a_deepspeed_learner_process_never_imports_mlflow(tmp_path):
    """DeepSpeed's autotuner (never run by this package) imports MLflow when it is installed, about a
    second of every learner process's start; a whole DeepSpeed run imports DeepSpeed without it, and
    MLflow stays importable in that process afterwards."""
    import json
    import subprocess
    import sys

    from tests.helpers import clean_env

    pytest.importorskip("mlflow")
    pytest.importorskip("deepspeed")
    proc = subprocess.run([sys.executable, "-c", _DEEPSPEED_RUN], capture_output=True, text=True, cwd=tmp_path,
                          env=clean_env({"RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"code": 0, "loaded": False, "autotuner": False, "later": "mlflow"}


def test_the_shipped_models_are_the_recorded_ones():
    """Every machine trains the same tiny models: they ship with the package, byte for byte."""
    import hashlib

    from rlhf_plugins.models.tiny_model import DIGESTS, SHIPPED, default_model_path
    from rlhf_plugins.models.tool_model import tool_model_path

    assert {default_model_path(), tool_model_path()} == {str(SHIPPED / name) for name in DIGESTS}
    for name, digest in DIGESTS.items():
        assert hashlib.sha256((SHIPPED / name / "model.safetensors").read_bytes()).hexdigest() == digest, name


def test_a_cuda_ipc_handle_is_opened_on_this_processs_gpu(monkeypatch):
    """The receiver of a CUDA IPC handle rebuilds the tensor on its own current device: the argument is
    found by name in torch's rebuild function (``storage_device``), not by its place in the tuple."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from rlhf_plugins.sync.ipc import with_this_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    args = tuple(f"arg{i}" for i in range(15))
    rebuilt = with_this_device(rebuild_cuda_tensor, args)
    import inspect

    names = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert rebuilt[names.index("storage_device")] == 3
    assert [a for i, a in enumerate(rebuilt) if i != names.index("storage_device")] == \
        [a for i, a in enumerate(args) if i != names.index("storage_device")]
    with pytest.raises(RuntimeError, match="takes no storage_device"):
        with_this_device(lambda tensor_cls, size: None, ("a", "b"))


def _engine_and_samples(tiny_model):
    from rlhf_plugins import SamplingParams
    from rlhf_plugins.api import prepare
    from rlhf_plugins.engines.transformers_engine import TransformersEngine
    from rlhf_plugins.testing import backend_context

    config, pm, _ = prepare({}, autoload=False)
    engine = TransformersEngine(backend_context(config, "generation", tiny_model, pm))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, engine.model.config.vocab_size, (n,), generator=g).tolist() for n in (6, 40, 35)]
    return engine, engine.generate(prompts, SamplingParams(n=4, max_new_tokens=12, temperature=1.3, seed=5))


@pytest.fixture
def fresh_probe():
    from rlhf_plugins.models import speedups

    speedups.supported.cache_clear()
    yield speedups
    speedups.supported.cache_clear()


@needs_speedups
def test_the_speedups_switch_runs_transformers_own_cache_and_attention(tiny_model, monkeypatch, fresh_probe):
    """RLHF_SPEEDUPS=0: no reserved cache, no cascade, transformers' SDPA -- and the same samples."""
    from rlhf_plugins.engines import transformers_engine

    fast_engine, fast = _engine_and_samples(tiny_model)
    assert fast_engine.shared_prefix
    made = []
    real = transformers_engine.reserved_cache
    monkeypatch.setattr(transformers_engine, "reserved_cache", lambda *a: made.append(1) or real(*a))
    monkeypatch.setenv(fresh_probe.ENV, "0")
    engine, plain = _engine_and_samples(tiny_model)
    assert not engine.shared_prefix and engine.model.config._attn_implementation == "sdpa" and made == []
    assert_same_samples(plain, fast, atol=1e-5)


@needs_speedups
def test_unexpected_transformers_internals_fall_back_with_one_line(tiny_model, monkeypatch, caplog, fresh_probe):
    """What transformers 4.57 did (a cache-layer method with another signature): one warning line,
    then transformers' own cache and attention, and generation works."""
    from rlhf_plugins.models import kv_cache

    def older_signature(self, key_states):
        raise AssertionError("not reached")

    monkeypatch.setattr(kv_cache.DynamicLayer, "lazy_initialization", older_signature)
    with caplog.at_level("WARNING", logger="rlhf_plugins"):
        assert fresh_probe.enabled() is False
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "TypeError" in lines[0] and "its own KV cache and attention run instead" in lines[0]
    assert "\n" not in lines[0]
    monkeypatch.undo()  # generation needs transformers' real cache layer back; the probe's answer is kept
    engine, samples = _engine_and_samples(tiny_model)
    assert not engine.shared_prefix and len(samples) == 12 and all(samples.completion_ids)


def test_temperature_zero_is_greedy_decoding_with_the_models_own_logprobs(tiny_model):
    """As in vLLM: temperature 0 takes the most likely token every step (the same tokens as top-k 1)
    and reports its log-prob under the untempered distribution -- not a division by zero."""
    from rlhf_plugins import SamplingParams

    engine, _ = _engine_and_samples(tiny_model)
    prompts = [[1, 4, 23, 16, 24, 34, 5], [1, 4, 22, 16, 27, 34, 5]]
    greedy = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=5, temperature=0.0))
    top1 = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=5, top_k=1, seed=1))
    assert greedy.completion_ids == top1.completion_ids
    for prompt, completion, logps in zip(prompts, greedy.completion_ids, greedy.logprobs):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = engine.model(ids).logits[0, len(prompt) - 1:-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(logps), expected, rtol=0, atol=1e-4)
        assert torch.equal(logits.argmax(-1), torch.tensor(completion))


def test_the_kv_cache_and_checkpointing_names_follow_the_models_own_forward():
    """transformers renamed ``past_key_values`` to ``cache`` (5.2x; the old name goes in 5.40) and
    ``is_gradient_checkpointing`` to ``is_activation_checkpointing`` (the old one goes in 6): each is
    asked of the model in hand (a PEFT model's base), so older releases and remote-code models keep theirs."""
    from types import SimpleNamespace

    from rlhf_plugins.models.hf_names import cache_argument, checkpointing, output_cache

    class Renamed(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=False):
            return input_ids

    class Older(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=False):
            return input_ids

    class Peft(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base

        def get_base_model(self):
            return self.base

        def forward(self, *args, **kwargs):
            return self.base(*args, **kwargs)

    kv = object()
    assert cache_argument(Renamed(), kv) == {"cache": kv} and cache_argument(Older(), kv) == {"past_key_values": kv}
    assert cache_argument(Peft(Renamed()), kv) == {"cache": kv}
    assert cache_argument(Peft(Older()), kv) == {"past_key_values": kv}
    assert output_cache(SimpleNamespace(cache=kv)) is kv and output_cache(SimpleNamespace(past_key_values=kv)) is kv
    assert output_cache(SimpleNamespace(cache=None, past_key_values=kv)) is kv
    assert checkpointing(SimpleNamespace(is_activation_checkpointing=True))
    assert checkpointing(SimpleNamespace(is_gradient_checkpointing=True))
    assert not checkpointing(SimpleNamespace(is_activation_checkpointing=False, is_gradient_checkpointing=True))
    assert not checkpointing(SimpleNamespace())


def test_checkpointing_is_turned_on_under_the_name_the_models_transformers_has(tiny_model):
    """transformers 5.25 renamed ``gradient_checkpointing_enable`` ``activation_checkpointing_enable`` (the
    old name warns): a model that has the new name is asked by it, one that has only the old by that, both
    non-reentrant; a real policy and critic end up checkpointing with no deprecation warning of the name."""
    import warnings

    from transformers import AutoModelForCausalLM

    from rlhf_plugins.models.hf_names import checkpointing, enable_checkpointing
    from rlhf_plugins.models.value_model import ValueModel

    calls = []

    class Older:
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(("old", gradient_checkpointing_kwargs))

    class Newer(Older):
        def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
            calls.append(("new", activation_checkpointing_kwargs))

    enable_checkpointing(Older())
    enable_checkpointing(Newer())
    assert calls == [("old", {"use_reentrant": False}), ("new", {"use_reentrant": False})]
    policy = AutoModelForCausalLM.from_pretrained(tiny_model)
    critic = ValueModel(AutoModelForCausalLM.from_pretrained(tiny_model).model)
    assert not checkpointing(policy) and not critic.is_activation_checkpointing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_checkpointing(policy)
        critic.gradient_checkpointing_enable()
    assert checkpointing(policy) and critic.is_activation_checkpointing
    assert [str(w.message) for w in caught if "checkpointing" in str(w.message)] == []


def test_our_forwards_and_sampling_use_the_installed_transformers_names(model, tiny_model):
    """The shared-prompt forward (a KV cache passed and read back), a critic's forward with gradient
    checkpointing asked, and the engine's prefill and decode steps raise none of transformers'
    deprecation warnings for the renamed cache argument or checkpointing flag (run on the newest
    releases by ``COMPAT_RESOLUTION=highest scripts/compat.sh``), and the shared-prompt path still runs."""
    import warnings

    from rlhf_plugins import SamplingParams
    from rlhf_plugins.api import prepare
    from rlhf_plugins.engines.transformers_engine import TransformersEngine
    from rlhf_plugins.models.forward import value_forward
    from rlhf_plugins.models.value_model import ValueModel
    from rlhf_plugins.testing import backend_context

    config, pm, _ = prepare({}, autoload=False)
    engine = TransformersEngine(backend_context(config, "generation", tiny_model, pm))
    critic = ValueModel(model.model)
    batch = random_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shared = policy_forward(model, batch)["logprobs"]
        values = value_forward(critic, batch)["values"]  # the critic's shared-prompt forward
        assert not critic.is_activation_checkpointing
        for prefix in (True, False):
            engine.shared_prefix = prefix
            out = engine.generate([[5, 6, 7] * 6, [8, 9] * 9], SamplingParams(n=2, max_new_tokens=4, seed=0))
            assert len(out.completion_ids) == 4
    renamed = [str(w.message) for w in caught
               if any(name in str(w.message) for name in ("past_key_values", "cache_params", "is_gradient_checkpointing"))]
    assert renamed == []
    plain = policy_forward(model, dict(batch, group_size=1))["logprobs"]
    assert (shared - plain).abs()[batch["action_mask"].bool()].max() < 1e-5
    plain_values = value_forward(critic, dict(batch, group_size=1))["values"]
    assert (values - plain_values).abs()[batch["action_mask"].bool()].max() < 1e-4
