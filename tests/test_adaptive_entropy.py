"""The adaptive entropy bonus (--algo.policy_loss.entropy_target; Skywork-OR1, TRL's use_adaptive_entropy):
the coefficient's course against TRL 1.16's rule written out, the bonus applied in the loss with the
coefficient of its step, a run's logged coefficients by hand, exact resume, TRL's fields."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_plugins.algorithms import policy_losses
from rlhf_plugins.algorithms.entropy_control import AdaptiveEntropyCoef, FixedEntropyCoef
from rlhf_plugins.algorithms.objective import Objective
from rlhf_plugins.api import prepare
from tests.helpers import TINY_CHUNKS, WHOLE_LOGITS, metrics_of, short_run


def trl_course(entropies: list[float], coef: float, target: float, delta: float, low: float,
               high: float) -> list[float]:
    """TRL's GRPOTrainer with use_adaptive_entropy, one optimizer step per measurement: the coefficient
    each step applies (the bonus only while the last window's entropy is at or below the target;
    none before the first), then its move."""
    last, applied = float("inf"), []
    for entropy in entropies:
        applied.append(coef if last <= target else 0.0)
        coef = min(coef + delta, high) if entropy <= target else max(coef - delta, low)
        last = entropy
    return applied


def test_the_coefficients_course_is_trls():
    entropies = [0.9, 0.4, 0.3, 0.35, 0.6, 0.7, 0.2, 0.1, 0.1, 0.1]
    ours = AdaptiveEntropyCoef(0.01, target=0.5, delta=0.02, low=0.0, high=0.05)
    applied = []
    for e in entropies:
        applied.append(ours.value)
        logged = ours.update({"entropy": e})
        assert logged == {"entropy/coef": applied[-1]}
    assert applied == pytest.approx(trl_course(entropies, 0.01, 0.5, 0.02, 0.0, 0.05), abs=1e-15)
    assert max(applied) == pytest.approx(0.05) and applied[0] == 0.0 and 0.0 in applied[5:7]  # bounded, gated
    assert ours.update({}) == {}  # a step the actor did not train leaves it as it was
    fixed = FixedEntropyCoef(0.03)
    assert fixed.value == 0.03 and fixed.update({"entropy": 9.0}) == {} and fixed.value == 0.03


def test_the_objective_applies_its_steps_coefficient_and_always_measures_entropy():
    config, _, _ = prepare({"algo": {"policy_loss": {"entropy_target": 0.5}}}, autoload=False)
    objective = Objective(policy_losses.ppo, config.algo.policy_loss)
    assert objective.bonus == 0.0 and objective.needs_entropy  # measured even while the bonus is 0
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g)
    batch = {"action_mask": torch.ones(4, 6), "advantages": torch.randn(4, 6, generator=g)}
    outputs = {"logprobs": lp, "entropy": torch.rand(4, 6, generator=g)}
    plain, m = objective(outputs, batch)
    with_bonus, _ = Objective(policy_losses.ppo, config.algo.policy_loss, entropy_coef=0.2)(outputs, batch)
    assert float(plain - with_bonus) == pytest.approx(0.2 * float(m["entropy"]), rel=1e-6)


def test_a_runs_coefficients_and_resume(rlhf):
    """The target far above the tiny model's entropy: no bonus at step 0 (nothing measured yet), then
    0.01 + delta per step; the loss carries it. Resumed from step 1's checkpoint, step 2 is the same."""
    flags = ["--algo.policy_loss.entropy_target", "100", "--algo.policy_loss.entropy_coef", "0.01",
             "--algo.policy_loss.entropy_coef_delta", "0.02", "--algo.kl.coef", "0"]
    code, _, err = rlhf("train", *flags, *short_run("--train.run_name", "whole"))
    assert code == 0, err
    rows = metrics_of(Path("runs/whole"))
    assert [r["entropy/coef"] for r in rows] == pytest.approx([0.0, 0.03, 0.05])
    for r in rows:  # loss = policy - coef x entropy (no KL term)
        assert r["loss/total"] == pytest.approx(r["loss/policy"] - r["entropy/coef"] * r["entropy"], rel=1e-5, abs=1e-6)
    code, _, err = rlhf("train", *flags, *short_run("--train.run_name", "cut", "--train.steps", "2"))
    assert code == 0, err
    code, _, err = rlhf("train", "--resume", "runs/cut", "--train.steps", "3")
    assert code == 0, err
    assert metrics_of(Path("runs/cut"))[2]["entropy/coef"] == pytest.approx(0.05)


def test_trls_fields_map_to_the_adaptive_bonus():
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    raw, notes = from_grpo_fields({"use_adaptive_entropy": True, "entropy_target": 0.3, "entropy_coef": 0.001,
                                   "entropy_coef_delta": 0.002, "entropy_coef_max": 0.01})
    p = raw["algo"]["policy_loss"]
    assert (p["entropy_target"], p["entropy_coef"], p["entropy_coef_delta"], p["entropy_coef_min"],
            p["entropy_coef_max"]) == (0.3, 0.001, 0.002, 0.0, 0.01)
    assert not any("adaptive" in n for n in notes)  # one update per rollout: the same counting as TRL's
    raw, notes = from_grpo_fields({"use_adaptive_entropy": True, "gradient_accumulation_steps": 2,
                                   "steps_per_generation": 4})
    assert any("after each rollout here (2 optimizer updates)" in n for n in notes)
    raw, _ = from_grpo_fields({"entropy_target": 0.3})  # TRL reads it only with use_adaptive_entropy
    assert "entropy_target" not in raw["algo"]["policy_loss"]


@pytest.mark.parametrize("logits_mb", [TINY_CHUNKS, WHOLE_LOGITS], ids=["head-in-chunks", "whole-logits"])
def test_log_entropy_logs_the_policys_entropy_and_leaves_the_update_as_it_was(logits_mb):
    """``--algo.policy_loss.log_entropy`` (set by TRL's configs: TRL logs ``entropy`` at every step): the
    update's ``entropy`` is the token mean of the policy's entropy over the batch's completions, by hand
    in float64 from the model before the update; the weights after it equal those of the update
    without it, bit for bit (nothing reaches the loss)."""
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.models.tiny_model import default_model_path
    from tests.helpers import ppo_batch, random_rollout, sampling_logprobs, torch_learner

    rollout = random_rollout(group=4, prompts=3, seed=5)  # ppo_batch(5)'s samples
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    per_token = []
    for prompt, completion in zip(rollout.prompt_ids, rollout.completion_ids):
        probs = sampling_logprobs(model, prompt, completion, 1.0)[1]
        per_token += (-(probs * probs.clamp_min(1e-300).log()).sum(-1)).tolist()
    want = sum(per_token) / len(per_token)
    updates = {}
    for logged in (False, True):
        config, _, _ = prepare({"algo": {"policy_loss": {"log_entropy": logged}}}, autoload=False)
        objective = Objective(policy_losses.ppo, config.algo.policy_loss)
        assert objective.needs_entropy is logged and objective.bonus == 0.0
        learner = torch_learner("float32", logits_memory_mb=logits_mb)
        metrics = learner.train(ppo_batch(5), objective)
        assert ("entropy" in metrics) is logged
        updates[logged] = [p.detach().clone() for p in learner.model.parameters()]
    assert metrics["entropy"] == pytest.approx(want, rel=1e-5) and 1.0 < want < 6.0
    assert all(torch.equal(a, b) for a, b in zip(updates[False], updates[True]))


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                         "seq-mean-token-sum-norm"])
def test_the_logged_entropy_is_nats_per_token_and_the_bonus_is_aggregated_as_the_loss(aggregation):
    """``entropy`` (the adaptive target's measure, TRL's logged entropy) is the token mean over the
    completions whatever the aggregation; the bonus in the loss is aggregated as the policy loss is, by
    hand for each mode on ragged completions."""
    config, _, _ = prepare({"algo": {"policy_loss": {"aggregation": aggregation, "log_entropy": True}}}, autoload=False)
    g = torch.Generator().manual_seed(3)
    lengths = [6, 2, 4]
    mask = torch.tensor([[1.0] * n + [0.0] * (6 - n) for n in lengths])
    batch = {"action_mask": mask, "advantages": torch.randn(3, 6, generator=g)}
    outputs = {"logprobs": -torch.rand(3, 6, generator=g), "entropy": torch.rand(3, 6, generator=g) * 3}
    ent = outputs["entropy"]
    sums = [float(ent[i, :n].sum()) for i, n in enumerate(lengths)]
    by_hand = {"token-mean": sum(sums) / 12, "seq-mean-token-mean": sum(s / n for s, n in zip(sums, lengths)) / 3,
               "seq-mean-token-sum": sum(sums) / 3, "seq-mean-token-sum-norm": sum(sums) / 3 / 8}[aggregation]
    plain, metrics = Objective(policy_losses.ppo, config.algo.policy_loss, norm_length=8)(outputs, batch)
    bonus, _ = Objective(policy_losses.ppo, config.algo.policy_loss, norm_length=8, entropy_coef=0.5)(outputs, batch)
    assert float(metrics["entropy"]) == pytest.approx(sum(sums) / 12, rel=1e-6)
    assert float(plain - bonus) == pytest.approx(0.5 * by_hand, rel=1e-5)
