"""Sequence packing (--learner.max_tokens_per_micro_batch): packed micro batches give the padded
computation's log-probs and gradients, for every loss aggregation."""
from __future__ import annotations

import pytest
import torch

from rlhf_plugins.algorithms import policy_losses
from rlhf_plugins.algorithms.objective import Objective
from rlhf_plugins.config.schema import PolicyLossConfig
from rlhf_plugins.models.forward import policy_forward, split_batch
from rlhf_plugins.models.packing import in_token_budget, token_budget_split
from rlhf_plugins.training.rollout import Rollout, make_batch
from tests.helpers import all_rows_of, short_run, speedups_supported, the_run


def tiny_llama64(attn_implementation="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                      attn_implementation=attn_implementation)
    return LlamaForCausalLM(cfg).double().eval()


def spread_batch(n=10, seed=0):
    """Prompts of 2-9 tokens and completions of 1-20 (a multi-turn one with a masked gap)."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions, masks = [], [], []
    for i in range(n):
        prompts.append(torch.randint(1, 64, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist())
        c = torch.randint(1, 64, (int(torch.randint(1, 21, (1,), generator=g)),), generator=g).tolist()
        completions.append(c)
        masks.append([1] * len(c) if i % 3 else [1 if j % 4 else 0 for j in range(len(c))])
    r = Rollout([""] * n, prompts, completions, [""] * n, ["stop"] * n, [[0.0] * len(c) for c in completions], {}, 1,
                scores=[0.0] * n, action_masks=masks)
    batch = make_batch(r, pad_id=0)
    batch["advantages"] = torch.randn(batch["action_mask"].shape, generator=g, dtype=torch.float64)
    batch["old_logprobs"] = -torch.rand(batch["action_mask"].shape, generator=g, dtype=torch.float64) * 3
    return batch


def test_token_budget_split_packs_samples_longest_first_within_the_budget():
    batch = spread_batch()
    lengths = batch["attention_mask"].sum(-1).tolist()
    parts = token_budget_split(batch, 30)
    rows = [int(i) for p in parts for i in p["rows"]]
    assert sorted(rows) == list(range(len(lengths))) and len(parts) > 2  # every sample once
    for p in parts:
        used = [lengths[int(i)] for i in p["rows"]]
        assert used == sorted(used, reverse=True)  # placed longest first
        assert sum(used) <= 30 or len(used) == 1  # a sample longer than the budget goes alone
        assert p["packed"] is True and torch.equal(p["sequences"], batch["sequences"][p["rows"]])


def test_token_budget_split_puts_each_sample_in_the_first_micro_batch_with_room():
    # samples of 9, 2, 7, 3, 8, 5 tokens, budget 12, by hand (first-fit decreasing): 9 | 8 | 7;
    # 5 fits only beside 7; 3 beside 9; 2 beside 8 -> three micro batches, each full or nearly
    # (taking them in turn and closing a micro batch when the next does not fit would need four)
    lengths = [9, 2, 7, 3, 8, 5]
    r = Rollout([""] * 6, [[1]] * 6, [[2] * (n - 1) for n in lengths], [""] * 6, ["stop"] * 6,
                [[0.0] * (n - 1) for n in lengths], {}, 1, scores=[0.0] * 6)
    parts = token_budget_split(make_batch(r, pad_id=0), 12)
    assert [[lengths[int(i)] for i in p["rows"]] for p in parts] == [[9, 3], [8, 2], [7, 5]]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_logprobs_equal_the_padded_forward(implementation, monkeypatch):
    """Under SDPA the packed rows' attention runs per sample (its calls counted); under any other
    attention transformers' packed-sequence mask keeps it inside each sample."""
    from rlhf_plugins.models import attention

    calls = []
    per_sample = attention.per_sample_attention
    monkeypatch.setattr(attention, "per_sample_attention", lambda *a: calls.append(len(a[3])) or per_sample(*a))
    model, batch = tiny_llama64(implementation), spread_batch()
    with torch.no_grad():
        # the padded reference under SDPA (eager attention turns fully masked pad rows into NaN in float64)
        padded = policy_forward(tiny_llama64(), batch)["logprobs"]
        packed = in_token_budget(lambda part: policy_forward(model, part)["logprobs"], batch, 40)
    mask = batch["action_mask"].bool()
    assert torch.allclose(packed[mask], padded[mask], rtol=0, atol=1e-6)
    parts = len(token_budget_split(batch, 40))
    per_sample_runs = implementation == "sdpa" and speedups_supported()  # else transformers' packed mask
    assert len(calls) == (parts * model.config.num_hidden_layers if per_sample_runs else 0)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_per_sample_attention_equals_softmax_under_a_block_diagonal_causal_mask(kv_heads):
    from rlhf_plugins.models.attention import per_sample_attention

    g = torch.Generator().manual_seed(kv_heads)
    rows = [[(0, 5), (5, 7), (12, 1), (13, 3)], [(0, 16)], [(0, 9), (9, 7)]]
    q = torch.randn(3, 4, 16, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, kv_heads, 16, 8, generator=g, dtype=torch.float64) for _ in range(2))
    got = per_sample_attention(q, k, v, rows, 0.3)
    # independent: explicit scores, -inf outside a token's own sample and its future, softmax
    sample = torch.tensor([[i for i, (_, n) in enumerate(row) for _ in range(n)] for row in rows])
    t = torch.arange(16)
    allowed = (sample[:, :, None] == sample[:, None, :]) & (t[None, :, None] >= t[None, None, :])
    kk, vv = k.repeat_interleave(4 // kv_heads, 1), v.repeat_interleave(4 // kv_heads, 1)
    scores = (q @ kk.transpose(-1, -2) * 0.3).masked_fill(~allowed[:, None], float("-inf"))
    want = (torch.softmax(scores, -1) @ vv).transpose(1, 2)
    assert got.shape == (3, 16, 4, 8) and torch.allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_per_sample_attention_lets_each_completion_attend_to_its_prompts_segment(kv_heads):
    from rlhf_plugins.models.attention import per_sample_attention

    g = torch.Generator().manual_seed(kv_heads)
    # a prompt of 4 then two completions reading it, a prompt of 3 then one completion, a pad segment
    row = [(0, 4), (4, 3, 0), (7, 2, 0), (9, 3), (12, 3, 3), (15, 1)]
    q = torch.randn(1, 4, 16, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, 16, 8, generator=g, dtype=torch.float64) for _ in range(2))
    got = per_sample_attention(q, k, v, [row], 0.3)
    # independent: a token sees its own segment's past and all of the segment its segment reads
    segment = torch.tensor([i for i, s in enumerate(row) for _ in range(s[1])])
    reads = torch.tensor([s[2] if len(s) == 3 else -1 for s in row])[segment]
    t = torch.arange(16)
    allowed = ((segment[:, None] == segment[None, :]) & (t[:, None] >= t[None, :])) | (reads[:, None] == segment[None, :])
    kk, vv = k.repeat_interleave(4 // kv_heads, 1), v.repeat_interleave(4 // kv_heads, 1)
    scores = (q @ kk.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
    want = (torch.softmax(scores, -1) @ vv).transpose(1, 2)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def grouped_batch(prompts=3, group=4, seed=0):
    """:func:`spread_batch`'s samples in groups of one prompt (consecutive, ``group_size`` set)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids, completions, masks = [], [], []
    for p in range(prompts):
        prompt = torch.randint(1, 64, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
        for i in range(group):
            c = torch.randint(1, 64, (int(torch.randint(1, 21, (1,), generator=g)),), generator=g).tolist()
            prompt_ids.append(prompt)
            completions.append(c)
            masks.append([1] * len(c) if (p + i) % 3 else [1 if j % 4 else 0 for j in range(len(c))])
    n = len(prompt_ids)
    r = Rollout([""] * n, prompt_ids, completions, [""] * n, ["stop"] * n, [[0.0] * len(c) for c in completions], {},
                group, scores=[0.0] * n, action_masks=masks)
    batch = make_batch(r, pad_id=0)
    batch["advantages"] = torch.randn(batch["action_mask"].shape, generator=g, dtype=torch.float64)
    batch["old_logprobs"] = -torch.rand(batch["action_mask"].shape, generator=g, dtype=torch.float64) * 3
    return batch


def backward_of_parts(model, parts, batch, objective) -> torch.Tensor:
    """Each micro batch's loss, weighted by its share of ``batch``, backward through ``model``; the packed
    micro batches' log-probs in ``batch``'s layout (zeros for the rest)."""
    logprobs = torch.zeros(batch["action_mask"].shape, dtype=torch.float64)
    for part in parts:
        out = policy_forward(model, part)
        loss, _ = objective(out, part)
        (loss * objective.weight(part["action_mask"], batch["action_mask"])).backward()
        if "rows" in part:
            logprobs[part["rows"]] = out["logprobs"].detach()
    return logprobs


def test_token_budget_split_places_whole_groups_counting_each_prompt_once():
    from rlhf_plugins.models.packing import sharing_group

    batch = grouped_batch(prompts=4, group=3, seed=2)
    lengths = batch["attention_mask"].sum(-1)
    prompt = batch["attention_mask"][:, : -batch["action_mask"].shape[1]].sum(-1)
    shared = [int(prompt[i] + (lengths[i:i + 3] - prompt[i:i + 3]).sum()) for i in range(0, 12, 3)]
    budget = max(shared[0] + shared[1], max(shared))
    parts = token_budget_split(batch, budget, group=3)
    for part in parts:
        rows = part["rows"].tolist()
        assert part["group_size"] == 3 and len(rows) % 3 == 0
        assert all(rows[i:i + 3] == list(range(rows[i], rows[i] + 3)) and rows[i] % 3 == 0 for i in range(0, len(rows), 3))
        assert sum(shared[r // 3] for r in rows[::3]) <= budget
    assert sorted(r for p in parts for r in p["rows"].tolist()) == list(range(12))
    # groups of 33, 31, 28, 26 tokens counted shared (37-47 each counted whole): two micro batches of 61
    # and 57 tokens under a budget of 61, where whole samples would need four
    assert len(parts) == 2
    # a budget below a group's size: the group in consecutive runs that fit it, each counting the prompt
    runs = token_budget_split(batch, 20, group=3)
    for part in runs:
        rows = part["rows"].tolist()
        prompt_once = int(prompt[rows[0]] + (lengths[rows] - prompt[rows]).sum())
        assert prompt_once <= 20 or len(rows) == 1  # a sample longer than the budget goes alone
        assert rows == list(range(rows[0], rows[0] + len(rows))) and len({r // 3 for r in rows}) == 1
    assert sorted(r for p in runs for r in p["rows"].tolist()) == list(range(12))
    assert sharing_group(tiny_llama64(), batch) == (3 if speedups_supported() else 1)
    assert sharing_group(tiny_llama64("eager"), batch) == 1  # transformers' packed mask cannot share a prompt
    assert [p["group_size"] for p in token_budget_split(batch, budget)] == [1] * len(token_budget_split(batch, budget))


@pytest.mark.skipif(not speedups_supported(), reason="this transformers runs its own attention")
@pytest.mark.parametrize("fits", [True, False], ids=["whole-groups", "groups-in-runs"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_groups_hold_each_prompt_once_with_the_padded_gradients(mode, fits):
    """A packed micro batch of whole groups holds each prompt once, its samples' completions after it
    (the rows' widths counted), with the log-probs and gradients of every sample run whole and padded;
    so do groups cut into runs by a budget below a group's size."""
    batch = grouped_batch(seed=4)
    objective = Objective(policy_losses.ppo, PolicyLossConfig(aggregation=mode), norm_length=20)
    lengths, prompt = batch["attention_mask"].sum(-1), batch["attention_mask"][:, : -batch["action_mask"].shape[1]].sum(-1)
    budget = max(int(prompt[i] + (lengths[i:i + 4] - prompt[i:i + 4]).sum()) for i in range(0, 12, 4)) if fits else 30
    runs = []
    for parts in (split_batch(dict(batch, group_size=1), 3), token_budget_split(batch, budget, group=4)):
        model, widths = tiny_llama64(), []
        model.get_input_embeddings().register_forward_hook(lambda m, a, o, seen=widths: seen.append(a[0].shape[-1]))
        logprobs = backward_of_parts(model, parts, batch, objective)
        runs.append(({n: p.grad.clone() for n, p in model.named_parameters()}, widths, logprobs))
    (padded, _, _), (packed, widths, logprobs) = runs
    once = int(prompt[::4].sum() + (lengths - prompt).sum())
    assert sum(widths) == once if fits else once < sum(widths) < int(lengths.sum())  # each prompt once, or per run
    mask = batch["action_mask"].bool()
    with torch.no_grad():
        whole = policy_forward(tiny_llama64(), dict(batch, group_size=1))["logprobs"]
    assert torch.allclose(logprobs[mask], whole[mask], rtol=0, atol=1e-9)
    for name in padded:
        assert torch.allclose(packed[name], padded[name], rtol=1e-5, atol=1e-9), name


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_gradients_equal_the_padded_gradients(mode):
    batch = spread_batch(seed=3)
    objective = Objective(policy_losses.ppo, PolicyLossConfig(aggregation=mode), norm_length=20)
    grads = []
    for parts in (split_batch(batch, 3), token_budget_split(batch, 40)):
        model = tiny_llama64()
        for part in parts:
            loss, _ = objective(policy_forward(model, part), part)
            (loss * objective.weight(part["action_mask"], batch["action_mask"])).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    padded, packed = grads
    assert padded.keys() == packed.keys() and len(padded) > 10
    for name in padded:
        assert torch.allclose(packed[name], padded[name], rtol=1e-5, atol=1e-9), name


def test_a_run_with_packed_micro_batches_trains(rlhf):
    code, _, err = rlhf("train", *short_run("--learner.max_tokens_per_micro_batch", "48", "--algo.kl.coef", "0.01"))
    assert code == 0, err
    rows = [r for r in all_rows_of(the_run()) if "reward/mean" in r]
    assert len(rows) == 3 and all(r["grad_norm"] > 0 and r["kl"] >= 0 for r in rows)


def test_data_parallel_shards_of_packed_training_hold_about_equal_tokens():
    from rlhf_plugins.dispatch import shard_batch

    batch = spread_batch(n=12, seed=5)
    objective = Objective(policy_losses.ppo, PolicyLossConfig(aggregation="token-mean"))
    balanced = shard_batch({**batch, "balance_tokens": True}, 2, objective=objective)
    plain = shard_batch(batch, 2, objective=objective)

    def gap(shards):
        tokens = [int(s["attention_mask"].sum()) for s in shards]
        return abs(tokens[0] - tokens[1])

    longest = int(batch["attention_mask"].sum(-1).max())
    assert gap(balanced) <= longest and gap(balanced) <= gap(plain)
    # every sample in exactly one shard, and the shards' loss shares still add up to the whole
    rows = sorted(tuple(r.tolist()) for s in balanced for r in s["sequences"])
    assert rows == sorted(tuple(r.tolist()) for r in batch["sequences"])
    assert sum(s["dp_weight"] for s in balanced) == pytest.approx(2.0)


@pytest.mark.skipif(not speedups_supported(), reason="this transformers runs its own attention")
def test_a_mixture_of_experts_packs_its_groups_per_sample_with_the_padded_gradients():
    """Qwen3-MoE's attention is plain SDPA (as Qwen2-MoE's and Mixtral's), so its packed micro batches run
    it per sample and hold each group's prompt once: on a reduced Qwen3-30B-A3B (128 experts, 8 per token)
    in float64, the log-probs of every sample run whole and padded, and its gradients (the routers' and
    the experts' included)."""
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.models import attention
    from rlhf_plugins.testing import reduced_model_path

    path = reduced_model_path("qwen3-30b-a3b", layers=2, hidden=64)
    batch = grouped_batch(seed=4)
    objective = Objective(policy_losses.ppo, PolicyLossConfig(aggregation="seq-mean-token-mean"))
    runs = []
    for parts in (split_batch(dict(batch, group_size=1), 3), token_budget_split(batch, 200, group=4)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager").eval()
        logprobs = backward_of_parts(model, parts, batch, objective)
        runs.append(({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, model, logprobs))
    (padded, _, _), (packed, model, logprobs) = runs
    assert attention.enable(model)  # per-sample attention, each prompt once per group
    mask = batch["action_mask"].bool()
    with torch.no_grad():
        whole = policy_forward(model, dict(batch, group_size=1))["logprobs"]
    assert torch.allclose(logprobs[mask], whole[mask], rtol=0, atol=1e-9)
    assert padded.keys() == packed.keys() and any("gate" in n for n in packed)
    for name in padded:
        assert torch.allclose(packed[name], padded[name], rtol=1e-5, atol=1e-9), name


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("grouped", [True, False], ids=["groups-prompt-once", "samples-whole"])
def test_critic_values_of_packed_micro_batches_equal_the_padded_values(implementation, grouped):
    """The critic (a value head on the policy's backbone) in packed micro batches: each completion token's
    value and its gradient equal the padded forward's -- per sample (SDPA: the rows hold a group's prompt
    once, each completion attending to it alone) and through the block-diagonal mask (eager). The value
    model dropped the per-sample attention's argument, so its packed completions attended to each other
    (values off by 30 on a reduced Qwen2)."""
    from rlhf_plugins.models.forward import value_forward
    from rlhf_plugins.models.value_model import ValueModel

    def critic(implementation):
        model = ValueModel(tiny_llama64(implementation).model)
        torch.nn.init.normal_(model.value_head.weight, generator=torch.Generator().manual_seed(1))
        return model

    batch = grouped_batch(seed=5) if grouped else spread_batch(seed=5)
    mask = batch["action_mask"].bool()
    reference = critic("sdpa")  # the padded reference under SDPA (eager turns fully masked pad rows into NaN)
    padded = value_forward(reference, dict(batch, group_size=1))["values"]
    padded[mask].sum().backward()
    packed, model = torch.zeros_like(padded), critic(implementation)
    parts = token_budget_split(batch, 60, group=4 if grouped else 1)
    for part in parts:
        values = value_forward(model, part)["values"]
        values[part["action_mask"].bool()].sum().backward()
        packed[part["rows"]] = values.detach().to(packed.dtype)
    assert all(part.get("packed") for part in parts) and padded[mask].abs().max() > 1
    want = padded[mask].detach()
    assert (packed[mask] - want).abs().max() <= 1e-6 * want.abs().max()  # values are returned in float32
    grads = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        assert (grads[name].grad - p.grad).abs().max() <= 1e-6 * p.grad.abs().max(), name
