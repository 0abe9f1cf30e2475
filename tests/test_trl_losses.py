"""The policy losses TRL users bring (loss_type cispo, sapo, luspo) and DeepSeek-V3.2's off-policy
sequence masking (off_policy_mask_threshold): loss and gradient against TRL 1.16's formulas written
out in float64 on random off-policy inputs (the mask against TRL's own static method), TRL's fields,
the refusals, and a short run with each."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlhf_plugins.algorithms import policy_losses
from rlhf_plugins.algorithms.objective import Objective
from rlhf_plugins.api import prepare
from tests.helpers import metrics_of, short_run


def inputs(seed: int):
    """Ragged completions; ratios from about 0.2 to 5; one advantage per sequence of either sign."""
    g = torch.Generator().manual_seed(seed)
    B, T = 8, 11
    mask = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).double()
    logprobs = (-torch.rand(B, T, generator=g) * 3).double()
    old = logprobs + 0.7 * torch.randn(B, T, generator=g).double()
    rollout = old + 0.4 * torch.randn(B, T, generator=g).double()
    advantages = (torch.randn(B, 1, generator=g).double() * 2).expand(B, T) * mask
    return logprobs, old, rollout, advantages, mask


def options(**policy_loss):
    config, _, _ = prepare({"algo": {"policy_loss": {"aggregation": "token-mean", **policy_loss}}}, autoload=False)
    return config.algo.policy_loss


def ours(name: str, logprobs, old, advantages, mask, rollout=None, **policy_loss):
    """Our objective (no KL, no entropy) over the batch: loss, d loss / d logprobs, metrics."""
    objective = Objective(getattr(policy_losses, name), options(name=name, **policy_loss))
    lp = logprobs.clone().requires_grad_(True)
    batch = {"action_mask": mask, "old_logprobs": old, "advantages": advantages}
    if rollout is not None:
        batch["rollout_logprobs"] = rollout
    loss, metrics = objective({"logprobs": lp}, batch)
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), grad, metrics


def token_mean(per_token_loss, lp, mask):
    """TRL's dapo / cispo normaliser over one batch: the sum over completion tokens by their count."""
    loss = (per_token_loss * mask).sum() / mask.sum()
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), grad


def trl_cispo(logprobs, old, advantages, mask, epsilon_high: float):
    """TRL 1.16, loss_type cispo: ``-clamp(exp(logp - old), max=epsilon_high).detach() * A * logp``."""
    lp = logprobs.clone().requires_grad_(True)
    coef_1 = torch.exp(lp - old)
    return token_mean(-torch.clamp(coef_1, max=epsilon_high).detach() * advantages * lp, lp, mask)


def trl_sapo(logprobs, old, advantages, mask, pos: float, neg: float):
    """TRL 1.16, loss_type sapo: ``-sigmoid(tau (r - 1)) * 4 / tau * A``, tau by the advantage's sign."""
    lp = logprobs.clone().requires_grad_(True)
    coef_1 = torch.exp(lp - old)
    tau = torch.where(advantages > 0, pos, neg)
    return token_mean(-torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * advantages, lp, mask)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_is_trls_capped_weight_times_the_log_prob(seed):
    logprobs, old, _, advantages, mask = inputs(seed)
    loss, grad, metrics = ours("cispo", logprobs, old, advantages, mask, clip_high=1.5)
    their_loss, their_grad = trl_cispo(logprobs, old, advantages, mask, epsilon_high=2.5)
    assert loss == pytest.approx(their_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, their_grad, rtol=1e-9, atol=1e-12)
    ratio = torch.exp(logprobs - old)
    capped = (ratio > 2.5) & mask.bool()
    assert capped.any() and float(metrics["loss/clip_frac"]) == pytest.approx(float(capped.sum() / mask.sum()))
    # unlike the PPO clip, a token above the cap keeps a gradient: the cap's weight times its advantage
    torch.testing.assert_close(grad[capped], (-2.5 * advantages / mask.sum())[capped], rtol=1e-9, atol=0)
    assert (grad[capped] != 0).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sapo_is_trls_soft_gate(seed):
    logprobs, old, _, advantages, mask = inputs(seed)
    loss, grad, _ = ours("sapo", logprobs, old, advantages, mask, sapo_temperature_pos=0.8,
                         sapo_temperature_neg=1.3)
    their_loss, their_grad = trl_sapo(logprobs, old, advantages, mask, pos=0.8, neg=1.3)
    assert loss == pytest.approx(their_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, their_grad, rtol=1e-9, atol=1e-12)


def test_on_policy_cispo_and_sapo_are_the_plain_policy_gradient():
    """At ratio 1 both losses' gradient is -A / N per token, as PPO's."""
    logprobs, _, _, advantages, mask = inputs(5)
    _, ppo_grad, _ = ours("ppo", logprobs, logprobs.clone(), advantages, mask)
    torch.testing.assert_close(ppo_grad, -advantages / mask.sum(), rtol=1e-12, atol=1e-15)
    for name in ("cispo", "sapo"):
        _, grad, _ = ours(name, logprobs, logprobs.clone(), advantages, mask)
        torch.testing.assert_close(grad, ppo_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_off_policy_mask_is_trls(seed):
    """Against TRL's own ``GRPOTrainer.get_off_policy_mask``, sampling log-probs with NaN where vLLM
    could not score a token: the kept tokens, and the PPO loss and gradient over those only."""
    from trl import GRPOTrainer

    logprobs, old, rollout, advantages, mask = inputs(seed)
    rollout = rollout + torch.linspace(-0.2, 0.6, len(rollout), dtype=rollout.dtype)[:, None]  # drifts of both sides
    rollout[0, 0] = float("nan")
    threshold = 0.1
    theirs = GRPOTrainer.get_off_policy_mask(advantages[:, :1], logprobs, rollout, mask, threshold).expand_as(mask)
    kept = policy_losses.off_policy_mask(policy_losses.PolicyLossInputs(logprobs, old, advantages, mask, rollout),
                                         threshold)
    assert torch.equal(kept * mask, theirs * mask)
    assert 0 < float((theirs * mask).sum()) < float(mask.sum())  # some sequences dropped, some kept
    loss, grad, metrics = ours("ppo", logprobs, old, advantages, mask, rollout, off_policy_mask=threshold)
    lp = logprobs.clone().requires_grad_(True)
    ratio = torch.exp(lp - old)
    per_token = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages) * theirs
    their_loss, their_grad = token_mean(per_token, lp, mask)
    assert loss == pytest.approx(their_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, their_grad, rtol=1e-9, atol=1e-12)
    dropped = float(((1 - theirs) * mask).sum() / mask.sum())
    assert float(metrics["loss/off_policy_masked_frac"]) == pytest.approx(dropped)
    # without the engine's log-probs the rollout-time learner's (old) measure the drift, as TRL without vLLM
    without = policy_losses.off_policy_mask(policy_losses.PolicyLossInputs(logprobs, old, advantages, mask), threshold)
    trl_old = GRPOTrainer.get_off_policy_mask(advantages[:, :1], logprobs, old, mask, threshold).expand_as(mask)
    assert torch.equal(without * mask, trl_old * mask)


@pytest.mark.parametrize("fields, expected", [
    ({"loss_type": "cispo", "epsilon_high": 5.0},
     {"name": "cispo", "clip_high": 4.0, "aggregation": "token-mean"}),
    ({"loss_type": "sapo", "sapo_temperature_pos": 0.9, "sapo_temperature_neg": 1.2},
     {"name": "sapo", "aggregation": "seq-mean-token-mean", "sapo_temperature_pos": 0.9,
      "sapo_temperature_neg": 1.2}),
    ({"loss_type": "luspo", "importance_sampling_level": "sequence"},
     {"name": "gspo", "aggregation": "seq-mean-token-sum"}),
    ({"loss_type": "luspo"}, {"aggregation": "seq-mean-token-sum"}),
    ({"off_policy_mask_threshold": 0.5}, {"off_policy_mask": 0.5}),
])
def test_trl_fields_map_to_the_losses(fields, expected):
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    raw, _ = from_grpo_fields(fields)
    got = raw["algo"]["policy_loss"]
    assert {k: got.get(k) for k in expected} == expected
    if "name" not in expected:
        assert "name" not in got  # the clipped surrogate (ppo)


@pytest.mark.parametrize("fields, message", [
    ({"loss_type": "cispo"}, "caps the ratio at epsilon_high, here 0.2, below 1"),
    ({"loss_type": "sapo", "importance_sampling_level": "sequence"}, "set it to 'token'"),
    ({"loss_type": "vespo"}, "TRL loss_type 'vespo' has no equivalent"),
])
def test_trl_losses_without_an_equivalent_are_refused(fields, message):
    from rlhf_plugins.errors import ConfigError
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    with pytest.raises(ConfigError, match=message):
        from_grpo_fields(fields)


@pytest.mark.parametrize("name, logged", [("cispo", "loss/clip_frac"), ("sapo", "loss/ratio_mean")])
def test_each_loss_trains_with_the_off_policy_mask(rlhf, name, logged):
    """Two updates per rollout (the second off-policy), the mask on: the loss's own metric and the
    masked fraction are logged every step, and the policy moves."""
    code, _, err = rlhf("train", "--algo.policy_loss.name", name, "--algo.policy_loss.clip_high", "1",
                        "--algo.policy_loss.off_policy_mask", "0.0", "--learner.epochs", "2",
                        *short_run("--train.run_name", name))
    assert code == 0, err
    rows = metrics_of(Path("runs") / name)
    assert all(logged in r and 0 <= r["loss/off_policy_masked_frac"] <= 1 for r in rows)
    assert all(math.isfinite(r["loss/total"]) for r in rows) and any(r["grad_norm"] > 0 for r in rows)


def test_dual_clip_with_a_loss_that_has_no_clip_is_refused(rlhf):
    code, _, err = rlhf("train", "--algo.policy_loss.name", "cispo", "--algo.policy_loss.dual_clip", "3",
                        *short_run())
    assert code == 2 and err.strip().count("\n") == 0
    assert "algo.policy_loss.dual_clip" in err and "cispo" in err
