"""An update reads no tensor's value on the host between its forwards and backwards: on a GPU every
such read (``float(t)``, ``t.item()``, ``t.tolist()``, ``bool(t)``, ``t.cpu()``) waits for the queued
kernels to finish, and the GPU then sits idle while the host issues the next ones. Found on an H100
(docs/gpu.md, run 6: the update keeps the GPU busy 174 of its 270 ms)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from tests.helpers import ppo_batch, ppo_update, torch_learner

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")


def update_with_reads(monkeypatch, learner, objective=None):
    """One update of ``learner`` (PPO-clip at the defaults, or ``objective`` on a batch with reference
    and old log-probs), logging host reads of tensor values beside the starts and ends of its forwards
    and backwards."""
    events: list[str] = []
    def reader(name: str) -> Any:
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            events.append(f"read {name}")
            return real(self, *args, **kwargs)
        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, reader(name))

    def logged(kind, real):
        def call(*args, **kwargs):
            events.append(f"{kind} start")
            out = real(*args, **kwargs)
            events.append(f"{kind} end")
            return out
        return call

    monkeypatch.setattr(learner, "forward", logged("forward", learner.forward))
    monkeypatch.setattr(learner, "_backward", logged("backward", learner._backward))
    hooks = [learner.model.register_forward_pre_hook(lambda module, args: events.append("model start")),
             learner.model.register_forward_hook(lambda module, args, out: events.append("model end"))]
    if objective is None:
        metrics = ppo_update(learner, ppo_batch())
    else:
        batch = ppo_batch()
        g = torch.Generator().manual_seed(1)
        for key in ("old_logprobs", "ref_logprobs"):
            batch[key] = (torch.randn(batch["action_mask"].shape, generator=g) * 0.1 - 2.0) * batch["action_mask"]
        metrics = learner.train(batch, objective)
    monkeypatch.undo()
    for hook in hooks:
        hook.remove()
    return events, metrics


def between_forwards_and_backwards(events: list[str]) -> list[str]:
    """The host reads after the first forward and before the last backward, outside the transformers
    model's own forward (which reads the padding mask as it begins); the learner's work around it --
    laying out packed rows, the output head's chunks, the loss -- counts."""
    first, last = events.index("forward start"), len(events) - events[::-1].index("backward end")
    inside_model, between = False, []
    for event in events[first:last]:
        if event in ("model start", "model end"):
            inside_model = event == "model start"
        elif event.startswith("read") and not inside_model:
            between.append(event)
    return between


@pytest.mark.parametrize("micro", [6, 4, "packed"])
def test_an_update_reads_no_tensor_value_between_its_forwards_and_backwards(monkeypatch, micro):
    """Micro batches of 6 and 4 samples, and packed micro batches of at most 24 tokens (each laid out
    before the first forward: laying one out reads it on the host)."""
    options = {"max_tokens_per_micro_batch": 24} if micro == "packed" else {"micro_batch_size": micro}
    events, _ = update_with_reads(monkeypatch, torch_learner("float32", **options))
    count = events.count("forward start")
    assert count > 2 if micro == "packed" else count == 12 // micro + (12 % micro > 0)
    between = between_forwards_and_backwards(events)
    assert between == [], f"host reads between the forwards and backwards of an update: {between}"
    last = len(events) - events[::-1].index("backward end")
    assert any(e.startswith("read") for e in events[last:]), "the metrics are read back after the last backward"


def objectives() -> dict[str, Any]:
    """Objectives whose parts run between a forward and its backward: GSPO, the dual clip, the KL
    term in the loss, an entropy bonus, the top-entropy mask, per-sequence aggregation, TIS."""
    from rlhf_plugins.algorithms import kl, policy_losses
    from rlhf_plugins.algorithms.objective import Objective
    from rlhf_plugins.api import prepare

    o = prepare({}, autoload=False)[0].algo.policy_loss
    return {"gspo": Objective(policy_losses.gspo, o),
            "dual clip": Objective(policy_losses.ppo, replace(o, dual_clip=3.0)),
            "kl in the loss": Objective(policy_losses.ppo, o, kl_estimator=kl.k3, kl_coef=0.01),
            "entropy bonus": Objective(policy_losses.ppo, replace(o, entropy_coef=0.01)),
            "top entropy": Objective(policy_losses.ppo, replace(o, top_entropy_quantile=0.2)),
            "seq-mean": Objective(policy_losses.ppo, replace(o, aggregation="seq-mean-token-mean")),
            "tis": Objective(policy_losses.ppo, replace(o, mismatch="tis"))}


@pytest.mark.parametrize("name", list(objectives()))
def test_the_objectives_read_nothing_between_a_forward_and_its_backward(monkeypatch, name):
    events, metrics = update_with_reads(monkeypatch, torch_learner("float32", micro_batch_size=6), objectives()[name])
    assert events.count("backward end") == 2 and "loss/total" in metrics
    assert between_forwards_and_backwards(events) == []


def test_the_metrics_of_micro_batches_add_up_to_the_whole_batchs():
    """Weighted by their share of the tokens, the micro batches' metrics (read back together after
    the last backward) are the whole batch's: the same weights, so the same forward values."""
    whole = ppo_update(torch_learner("float32", micro_batch_size=12), ppo_batch())
    parts = ppo_update(torch_learner("float32", micro_batch_size=4), ppo_batch())
    assert whole.keys() == parts.keys() and len(whole) > 3
    for key in whole:
        assert parts[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-6), key
