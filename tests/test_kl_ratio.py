"""The KL loss term weighted by the policy ratio (--algo.kl.ratio token | sequence; TRL's
use_bias_correction_kl, on by default there): loss and gradients against TRL's formula written out
independently in float64 on random inputs, the on-policy gradient's extra term by hand, TRL's fields,
and the refusal with KL in the reward."""
from __future__ import annotations

import pytest
import torch

from rlhf_plugins.algorithms import kl as kl_estimators
from rlhf_plugins.algorithms import policy_losses
from rlhf_plugins.algorithms.objective import Objective
from rlhf_plugins.api import prepare
from tests.helpers import short_run

BETA = 0.3


def inputs(seed: int, off_policy: bool):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    mask = (torch.rand(B, T, generator=g) > 0.25).double()
    mask[:, 0] = 1.0
    logprobs = (-torch.rand(B, T, generator=g) * 3).double()
    old = logprobs + 0.3 * torch.randn(B, T, generator=g).double() if off_policy else logprobs.clone()
    ref = logprobs + 0.5 * torch.randn(B, T, generator=g).double()
    advantages = torch.randn(B, 1, generator=g).double().expand(B, T) * mask
    return logprobs, old, ref, advantages, mask


def our_kl_term(logprobs, old, ref, advantages, mask, ratio: str, loss_name: str = "ppo"):
    """Our objective's loss minus its policy part (the KL term alone), and d(loss)/d(logprobs)."""
    config, _, _ = prepare({"algo": {"policy_loss": {"name": loss_name, "aggregation": "token-mean"}}},
                           autoload=False)
    objective = Objective(getattr(policy_losses, loss_name), config.algo.policy_loss, kl_estimator=kl_estimators.k3,
                          kl_coef=BETA, kl_ratio=ratio)
    lp = logprobs.clone().requires_grad_(True)
    loss, metrics = objective({"logprobs": lp}, {"action_mask": mask, "old_logprobs": old, "ref_logprobs": ref,
                                                 "advantages": advantages})
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss.detach() - metrics["loss/policy"]), grad, metrics


def trl_kl_term(logprobs, old, ref, mask, level: str):
    """TRL 1.16's GRPO KL term (loss_type bnpo / dapo: token mean over the batch), written out: k3 of
    the policy against the reference, times exp(log ratio) -- per token, or one per sequence from the
    mean of its tokens' log ratios -- with gradients through the ratio."""
    lp = logprobs.clone().requires_grad_(True)
    per_token_kl = torch.exp(ref - lp) - (ref - lp) - 1
    log_ratio = lp - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    kl_term = BETA * (per_token_kl * torch.exp(log_ratio) * mask).sum() / mask.sum()
    (grad,) = torch.autograd.grad(kl_term, lp)
    return float(kl_term.detach()), grad


@pytest.mark.parametrize("level, loss_name", [("token", "ppo"), ("sequence", "gspo")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_weighted_kl_term_is_trls_formula_with_its_gradient(level, loss_name, seed):
    """Off-policy inputs, advantages 0 (the policy loss then adds nothing to the gradient): our loss
    and its gradient are TRL's KL term's."""
    logprobs, old, ref, advantages, mask = inputs(seed, off_policy=True)
    ours, ours_grad, _ = our_kl_term(logprobs, old, ref, advantages * 0, mask, level, loss_name)
    theirs, theirs_grad = trl_kl_term(logprobs, old, ref, mask, level)
    assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-9, atol=1e-12)
    _, plain_grad, _ = our_kl_term(logprobs, old, ref, advantages * 0, mask, "none", loss_name)
    assert not torch.allclose(plain_grad, theirs_grad)  # the weighting changes the gradient


def test_on_policy_the_value_is_unchanged_and_the_gradient_gains_kl_times_grad_log_prob():
    """Ratio 1 in value: the same loss and KL metric as unweighted; in the gradient each token gains
    beta x kl / (number of tokens) (d/dlogp of kl x exp(logp - old) at logp = old)."""
    logprobs, _, ref, advantages, mask = inputs(3, off_policy=False)
    weighted, grad_w, m_w = our_kl_term(logprobs, logprobs.clone(), ref, advantages, mask, "token")
    plain, grad_p, m_p = our_kl_term(logprobs, logprobs.clone(), ref, advantages, mask, "none")
    assert weighted == pytest.approx(plain, rel=1e-12) and float(m_w["kl"]) == pytest.approx(float(m_p["kl"]))
    kl = torch.exp(ref - logprobs) - (ref - logprobs) - 1
    torch.testing.assert_close(grad_w - grad_p, BETA * kl * mask / mask.sum(), rtol=1e-9, atol=1e-12)


def test_k3_weighted_by_the_ratio_has_the_reverse_kl_gradient_of_openrlhfs_unbiased_gradient():
    """OpenRLHF's --algo.kl.unbiased_gradient keeps its estimator's value and makes the gradient
    w x log(pi / pi_ref) d log pi, w the policy ratio (capped at 10 there): k3 x ratio (--algo.kl.ratio token)
    has exactly that gradient below the cap (d/dlogp of r (e^-x - 1 + x) = r x, x = log(pi / pi_ref)), with
    k3 x ratio as its value (--algo.kl.unbiased_gradient: the estimator's own, the cap, any estimator)."""
    logprobs, old, ref, _, mask = inputs(4, off_policy=True)
    lp = logprobs.clone().requires_grad_(True)
    weighted = kl_estimators.k3(lp, ref) * kl_estimators.ratio_weights(lp, old, mask, "token")
    weighted.sum().backward()
    x = logprobs - ref
    torch.testing.assert_close(lp.grad, torch.exp(logprobs - old) * x, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(torch.exp(logprobs - old) * x, x)  # off-policy: the ratio matters


def openrlhf_unbiased_kl_term(logprobs, old, ref, mask, estimator: str):
    """OpenRLHF 0.11's compute_approx_kl(..., unbiased_gradient=True) under token-mean, written out: the
    estimator's clamped value, and by a straight-through surrogate the gradient w x (logp - ref) with
    w = min(pi / pi_old, 10) held constant."""
    lp = logprobs.clone().requires_grad_(True)
    x = lp - ref
    value = {"k1": x, "k2": x ** 2 / 2, "k3": (-x.clamp(min=-10)).exp() - 1 + x.clamp(min=-10)}[estimator]
    value = value.clamp(-10, 10)
    w = (lp - old).exp().clamp(max=10.0).detach()
    surrogate = w * x ** 2 / 2
    term = BETA * ((value.detach() + surrogate - surrogate.detach()) * mask).sum() / mask.sum()
    (grad,) = torch.autograd.grad(term, lp)
    return float(term.detach()), grad


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("seed", [5, 6])
def test_the_unbiased_gradient_is_openrlhfs_value_and_gradient_for_every_estimator(estimator, seed):
    """--algo.kl.unbiased_gradient: the KL term's value is the estimator's, its gradient
    beta x min(pi/pi_old, 10) x log(pi/pi_ref) / tokens whatever the estimator; some tokens' ratios pass the
    cap (which --algo.kl.ratio token does not have)."""
    logprobs, old, ref, advantages, mask = inputs(seed, off_policy=True)
    old[0, :3] = logprobs[0, :3] - 3.0  # ratio e^3 > 10: capped
    config, _, _ = prepare({"algo": {"policy_loss": {"aggregation": "token-mean"}}}, autoload=False)
    objective = Objective(policy_losses.ppo, config.algo.policy_loss, kl_estimator=getattr(kl_estimators, estimator),
                          kl_coef=BETA, kl_unbiased=True)
    lp = logprobs.clone().requires_grad_(True)
    loss, metrics = objective({"logprobs": lp}, {"action_mask": mask, "old_logprobs": old, "ref_logprobs": ref,
                                                 "advantages": advantages * 0})
    (grad,) = torch.autograd.grad(loss, lp)
    theirs, theirs_grad = openrlhf_unbiased_kl_term(logprobs, old, ref, mask, estimator)
    assert float(loss.detach() - metrics["loss/policy"]) == pytest.approx(theirs, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, theirs_grad, rtol=1e-9, atol=1e-12)
    by_hand = BETA * torch.exp(logprobs - old).clamp(max=10.0) * (logprobs - ref) * mask / mask.sum()
    torch.testing.assert_close(grad, by_hand, rtol=1e-9, atol=1e-12)
    _, ratio_grad, _ = our_kl_term(logprobs, old, ref, advantages * 0, mask, "token")
    assert not torch.allclose(grad, ratio_grad)  # the cap: k3 x ratio has the uncapped weight


def test_openrlhfs_unbiased_gradient_converts_with_kl_in_the_loss_and_is_listed_without():
    from rlhf_plugins.commands.convert import convert

    loss = convert(["--pretrain", "m", "--use_kl_loss", "--algo.kl.estimator", "k2", "--algo.kl.unbiased_gradient"])
    assert loss.raw["algo"]["kl"]["unbiased_gradient"] is True and loss.raw["algo"]["kl"]["estimator"] == "k2"
    reward = convert(["--pretrain", "m", "--algo.kl.unbiased_gradient"])
    assert "unbiased_gradient" not in reward.raw["algo"]["kl"]
    assert [flag for flag, why in reward.skipped if "KL is in the reward" in why] == ["--algo.kl.unbiased_gradient"]


@pytest.mark.parametrize("fields, ratio", [
    ({"beta": 0.04}, "token"),  # TRL's default use_bias_correction_kl=True
    ({"beta": 0.04, "importance_sampling_level": "sequence"}, "sequence"),
    ({"beta": 0.04, "use_bias_correction_kl": False}, None),
    ({}, None),  # beta 0 (TRL's default): no KL term to weight
])
def test_trl_fields_map_to_the_kl_ratio(fields, ratio):
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    raw, _ = from_grpo_fields(fields)
    assert raw["algo"]["kl"].get("ratio") == ratio


@pytest.mark.parametrize("args, expected", [
    (["--algo.kl.unbiased_gradient", "true", "--algo.kl.in_reward", "true"],
     "algo.kl.unbiased_gradient shapes the KL loss term's gradient"),
    (["--algo.kl.unbiased_gradient", "true", "--algo.kl.ratio", "token"], "drop --algo.kl.ratio token"),
])
def test_the_unbiased_gradient_without_a_kl_loss_or_with_a_ratio_is_refused(rlhf, args, expected):
    code, _, err = rlhf("train", *short_run(), *args)
    assert code == 2 and err.strip().count("\n") == 0 and expected in err


def test_a_ratio_with_kl_in_the_reward_is_refused(rlhf):
    code, _, err = rlhf("train", *short_run(), "--algo.kl.ratio", "token", "--algo.kl.in_reward", "true")
    assert code == 2 and err.strip().count("\n") == 0
    assert "algo.kl.ratio token weights the KL loss term" in err
