"""--learner.pad_to_multiple_of (rlhf_plugins.training.rollout: padded_width, make_batch): a batch's
prompt and completion widths rounded up so that a run's shapes repeat (CUDA graphs are recorded per
shape), with the padding masked out of everything: training on padded batches is training on tight ones."""
from __future__ import annotations

import pytest
import torch

from rlhf_plugins.api import prepare
from rlhf_plugins.training.rollout import GRAPH_WIDTH_MULTIPLE, Rollout, batch_widths, make_batch, padded_width
from tests.helpers import in_process_trainer


@pytest.mark.parametrize("width,multiple,budget,want", [
    (5, 64, 256, 64), (64, 64, 256, 64), (65, 64, 256, 128), (250, 64, 256, 256),  # capped at the budget
    (200, 64, 230, 230), (300, 64, 256, 320),  # past the budget: rounded up all the same
    (7, 1, 256, 7), (7, 0, None, 7), (7, 64, None, 64), (6, 16, 6, 6)])
def test_a_width_rounds_up_to_the_multiple_but_not_past_its_budget(width, multiple, budget, want):
    assert padded_width(width, multiple, budget) == want


def test_the_multiple_is_the_configs_or_64_where_the_learner_replays_cuda_graphs():
    def widths(**learner):
        return batch_widths(prepare({"learner": learner, "data": {"max_prompt_tokens": 100},
                                     "generation": {"max_new_tokens": 30}}, autoload=False)[0])

    assert widths() == {"multiple": 1, "budgets": (100, 30)}
    assert widths(compile=True)["multiple"] == 1
    assert GRAPH_WIDTH_MULTIPLE == 64
    for mode in ("reduce-overhead", "max-autotune"):
        assert widths(compile=True, compile_mode=mode)["multiple"] == 64
    assert widths(compile=True, compile_mode="reduce-overhead", pad_to_multiple_of=1)["multiple"] == 1
    assert widths(pad_to_multiple_of=8)["multiple"] == 8


def test_the_memory_plan_sizes_the_padded_widths():
    """Prompts of at most 7 tokens and 6-token completions: planned 7 + 6 wide, and 64 + 6 under a
    CUDA-graph mode (the completions' budget caps their padding), with more activation memory."""
    from rlhf_plugins.training.memory_plan import memory_plan

    plans = {}
    for mode in ("default", "reduce-overhead"):
        config, _, plan = prepare({"learner": {"compile": True, "compile_mode": mode}}, autoload=False)
        plans[mode] = memory_plan(config, plan, prompt_tokens=7)
    assert "sequences of up to 7 + 6 tokens" in plans["default"].workload
    assert "sequences of up to 64 + 6 tokens" in plans["reduce-overhead"].workload

    def activations(mplan):
        return sum(need.parts.get("activations", 0) for process in mplan.processes for need in process.needs)
    assert activations(plans["reduce-overhead"]) > activations(plans["default"]) > 0


def test_a_padded_batch_is_the_tight_one_with_masked_columns_around_it():
    """Prompts of 3 and 5 tokens, completions of 2 and 4, to a multiple of 8: the tight batch (widths 5
    and 4) sits at columns 3..12 of the padded one (widths 8 and 8), every other column is padding
    with a zero attention mask and a zero action mask."""
    rollout = Rollout([""] * 2, [[11, 12, 13], [21, 22, 23, 24, 25]], [[31, 32], [41, 42, 43, 44]], [""] * 2,
                      ["stop"] * 2, [[-0.5, -1.0], [-1.5] * 4], {}, 1, scores=[0.0] * 2)
    tight, padded = make_batch(rollout, pad_id=0), make_batch(rollout, pad_id=0, multiple=8, budgets=(64, 64))
    assert tight["sequences"].shape == (2, 9) and padded["sequences"].shape == (2, 16)
    for key in ("sequences", "attention_mask"):
        assert torch.equal(padded[key][:, 3:12], tight[key])
        assert not padded[key][:, :3].any() and not padded[key][:, 12:].any()
    for key in ("action_mask", "rollout_logprobs"):
        assert torch.equal(padded[key][:, :4], tight[key]) and not padded[key][:, 4:].any()
    assert padded["prompt_width"] == 8 and tight["prompt_width"] == 5


def test_training_on_padded_batches_equals_training_on_tight_ones(monkeypatch, tiny_model):
    """Two steps of the default task in float32 with a 20-token completion budget, batches padded to a
    multiple of 16 (prompts of about 7 tokens and completions of at most 20 become 16 and 16 or 20
    wide) and not: the learner saw the padded widths, and every metric of both steps -- rewards, KL,
    losses, gradient norms, log-prob gaps -- is the same to rounding."""
    raw = {"train": {"steps": 2, "prompts_per_step": 4}, "generation": {"n_samples_per_prompt": 4, "max_new_tokens": 20},
           "eval": {"enabled": False}, "algo": {"kl": {"coef": 0.01}}}
    runs, widths = {}, {}
    for multiple in (1, 16):
        t = in_process_trainer(tiny_model, {**raw, "learner": {"pad_to_multiple_of": multiple}})
        monkeypatch.setattr(t.actor, "train", _recording(t.actor.train, widths.setdefault(multiple, [])))
        try:
            runs[multiple] = [t.step(s) for s in range(2)]
        finally:
            t.shutdown()
    assert all(p == 16 and t in (16, 20) for p, t in widths[16]), widths
    assert all(p < 16 for p, _ in widths[1]) and any(t < 16 for _, t in widths[1]), widths
    for tight, padded in zip(runs[1], runs[16]):
        keys = [k for k in tight if not k.startswith(("time/", "memory/", "throughput/"))]  # all but clocks
        assert keys and set(keys) <= set(padded)
        for key in keys:
            assert padded[key] == pytest.approx(tight[key], rel=1e-4, abs=1e-6), key


def _recording(train, seen: list):
    """``train``, noting the prompt and completion widths of each batch it is given in ``seen``."""
    def call(batch, *args, **kwargs):
        seen.append((batch["prompt_width"], batch["action_mask"].shape[1]))
        return train(batch, *args, **kwargs)
    return call
