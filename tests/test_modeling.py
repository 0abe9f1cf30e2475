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
