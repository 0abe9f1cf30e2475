"""The policy losses TRL users bring (loss_type cispo, sapo, vespo, luspo; RLOOTrainer's), DeepSeek-V3.2's off-policy
sequence masking (off_policy_mask_threshold) and TRL's vLLM importance-sampling corrections: loss and
gradient against TRL 1.16's formulas written out in float64 on random off-policy inputs (the mask and
VESPO's weights against TRL's own static methods), TRL's fields, the refusals, and a short run with each."""
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
    # TRL's cispo_clip_ratio: (coef_1 > epsilon_high) & (advantages > 0), over the completion tokens
    theirs = ((ratio > 2.5) & (advantages > 0)).double()
    assert float(metrics["loss/clip_high_frac"]) == pytest.approx(float((theirs * mask).sum() / mask.sum()))
    assert 0 < float(metrics["loss/clip_high_frac"]) < float(metrics["loss/clip_frac"])
    # unlike the PPO clip, a token above the cap keeps a gradient: the cap's weight times its advantage
    torch.testing.assert_close(grad[capped], (-2.5 * advantages / mask.sum())[capped], rtol=1e-9, atol=0)
    assert (grad[capped] != 0).all()


def trl_rloo(logprobs, old, advantages, mask, epsilon_low: float, epsilon_high: float):
    """TRL 1.16's RLOOTrainer loss: the clipped surrogate of each completion's ratio ``exp(sum logp - sum old)``,
    ``-min(r A, clip(r) A)`` averaged over completions; and its clip shares, over completions."""
    lp = logprobs.clone().requires_grad_(True)
    coef_1 = torch.exp((lp * mask).sum(1) - (old * mask).sum(1))
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(coef_1 * advantages, coef_2 * advantages).mean()
    (grad,) = torch.autograd.grad(loss, lp)
    low = (coef_1 < 1 - epsilon_low) & (advantages < 0)
    high = (coef_1 > 1 + epsilon_high) & (advantages > 0)
    shares = {"low": float(low.double().mean()), "high": float(high.double().mean()),
              "region": float((low | high).double().mean())}
    return float(loss.detach()), grad, shares, coef_1.detach()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sequence_ppo_is_trls_rloo_loss(seed):
    """The completion's ratio is the product of its token ratios, clipped once: value, gradient and the
    clip shares (counted over completions, as TRL's) are TRL's; with ratios from e^-5 to e^5 the clip acts
    on both sides and some completions keep their gradient."""
    logprobs, old, _, advantages, mask = inputs(seed)
    per_sequence = advantages[:, 0]
    loss, grad, metrics = ours("sequence_ppo", logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28,
                               aggregation="seq-mean-token-mean")
    their_loss, their_grad, shares, ratio = trl_rloo(logprobs, old, per_sequence, mask, 0.2, 0.28)
    assert loss == pytest.approx(their_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, their_grad, rtol=1e-9, atol=1e-12)
    for theirs, ours_name in (("low", "loss/clip_low_frac"), ("high", "loss/clip_high_frac"),
                              ("region", "loss/clip_frac")):
        assert float(metrics[ours_name]) == pytest.approx(shares[theirs], abs=1e-12), theirs
    assert float(metrics["loss/ratio_mean"]) == pytest.approx(float(ratio.mean()))
    # RLOO's clip_ratio/low_min and /high_max: the extremes over completions of each one's clipped flag
    low, high = (ratio < 0.8) & (per_sequence < 0), (ratio > 1.28) & (per_sequence > 0)
    assert (float(metrics["loss/clip_low_seq_min"]), float(metrics["loss/clip_high_seq_max"])) == \
        (float(low.double().min()), float(high.double().max()))
    kept = (grad.abs().sum(1) > 0)
    assert 0 < shares["region"] < 1 and kept.any() and not kept.all()
    # a kept completion's gradient is -A r / B on each of its tokens: the whole ratio's, not one token's
    b = int(kept.nonzero()[0])
    want = -per_sequence[b] * ratio[b] / len(mask) * mask[b]
    torch.testing.assert_close(grad[b], want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sapo_is_trls_soft_gate(seed):
    logprobs, old, _, advantages, mask = inputs(seed)
    loss, grad, _ = ours("sapo", logprobs, old, advantages, mask, sapo_temperature_pos=0.8,
                         sapo_temperature_neg=1.3)
    their_loss, their_grad = trl_sapo(logprobs, old, advantages, mask, pos=0.8, neg=1.3)
    assert loss == pytest.approx(their_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, their_grad, rtol=1e-9, atol=1e-12)


def trl_sequence(logprobs, old, advantages, mask, loss_type: str, epsilon_high=5.0, pos=1.0, neg=1.05):
    """TRL 1.16 with importance_sampling_level "sequence": ``coef_1 = exp(mean_t(logp - old))`` per sequence
    ([B, 1]), then cispo's capped weight or sapo's gate on it; cispo's token-mean normaliser, sapo's mean of
    per-sequence token means. Advantages one per sequence, as TRL's."""
    lp = logprobs.clone().requires_grad_(True)
    adv = advantages[:, :1]
    coef_1 = torch.exp(((lp - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=epsilon_high).detach() * adv * lp
        return token_mean(per_token, lp, mask)
    tau = torch.where(adv > 0, pos, neg)
    per_token = (-torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv).expand_as(lp)
    loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sequence_level_cispo_and_sapo_are_trls(seed):
    """One ratio per sequence (``--algo.policy_loss.ratio_level sequence``; TRL's importance_sampling_level
    sequence): loss and gradient equal TRL's for cispo (token-mean) and sapo (seq-mean-token-mean), and differ
    from the token-level losses."""
    logprobs, old, _, advantages, mask = inputs(seed)
    loss, grad, _ = ours("cispo", logprobs, old, advantages, mask, clip_high=0.3, ratio_level="sequence")
    their_loss, their_grad = trl_sequence(logprobs, old, advantages, mask, "cispo", epsilon_high=1.3)
    assert loss == pytest.approx(their_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, their_grad, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(grad, ours("cispo", logprobs, old, advantages, mask, clip_high=0.3)[1])
    loss, grad, _ = ours("sapo", logprobs, old, advantages, mask, sapo_temperature_pos=0.8,
                         sapo_temperature_neg=1.3, ratio_level="sequence", aggregation="seq-mean-token-mean")
    their_loss, their_grad = trl_sequence(logprobs, old, advantages, mask, "sapo", pos=0.8, neg=1.3)
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
    ({"loss_type": "sapo", "importance_sampling_level": "sequence"}, {"name": "sapo", "ratio_level": "sequence"}),
    ({"loss_type": "cispo", "epsilon_high": 5.0, "importance_sampling_level": "sequence"},
     {"name": "cispo", "ratio_level": "sequence", "clip_high": 4.0}),
    ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, {"name": "vespo", "ratio_level": None}),
    ({"loss_type": "vespo", "use_vllm": True, "vllm_importance_sampling_mode": "token_truncate", "vespo_k_pos": 1.5},
     {"name": "vespo", "aggregation": "token-mean", "vespo_k_pos": 1.5, "mismatch": "tis"}),
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
    ({"loss_type": "sapo", "importance_sampling_level": "sequence_token"}, "set it to 'token'"),
    ({"loss_type": "opo"}, "TRL loss_type 'opo' has no equivalent"),
])
def test_trl_losses_without_an_equivalent_are_refused(fields, message):
    from rlhf_plugins.errors import ConfigError
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    with pytest.raises(ConfigError, match=message):
        from_grpo_fields(fields)


@pytest.mark.parametrize("name, logged", [("cispo", "loss/clip_frac"), ("sapo", "loss/ratio_mean"),
                                          ("vespo", "loss/vespo_phi_mean")])
def test_each_loss_trains_with_the_off_policy_mask(rlhf, name, logged):
    """Two updates per rollout (the second off-policy), the mask on: the loss's own metric and the
    masked fraction are logged every step, and the policy moves."""
    code, _, err = rlhf("train", "--algo.policy_loss.name", name, "--algo.policy_loss.clip_high", "1",
                        "--algo.policy_loss.mismatch", "tis",
                        "--algo.policy_loss.off_policy_mask", "0.0", "--learner.epochs", "2",
                        *short_run("--train.run_name", name))
    assert code == 0, err
    rows = metrics_of(Path("runs") / name)
    assert all(logged in r and 0 <= r["loss/off_policy_masked_frac"] <= 1 for r in rows)
    assert all(math.isfinite(r["loss/total"]) for r in rows) and any(r["grad_norm"] > 0 for r in rows)


def trl_is_ratio(old, sampling, mask, mode: str, clip_min, clip_max):
    """TRL 1.16's vLLM importance-sampling ratio (GRPOTrainer._generate_and_score_completions), written out."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@pytest.mark.parametrize("mode, clip_min, clip_max", [
    ("sequence_mask", None, 3.0),  # TRL's default with vLLM
    ("sequence_mask", 0.5, 2.0),
    ("sequence_truncate", None, 3.0),
    ("sequence_truncate", 0.8, 1.5),
    ("token_truncate", 0.3, 2.0),
    ("token_mask", None, None),
])
def test_trls_sampling_corrections_map_to_the_same_weights(mode, clip_min, clip_max):
    """Each vllm_importance_sampling_mode with its band, through the converter: the weights that multiply
    our per-token loss are TRL's importance_sampling_ratio, and the batch's mismatch figures are what TRL
    logs as sampling/sampling_logp_difference/{mean,max} and sampling/importance_sampling_ratio/{min,mean,max}
    (over the completion tokens, or over the sequences for the sequence modes)."""
    from rlhf_plugins.algorithms.mismatch import importance_weights
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    raw, _ = from_grpo_fields({"use_vllm": True, "vllm_importance_sampling_mode": mode,
                               "vllm_importance_sampling_clip_min": clip_min,
                               "vllm_importance_sampling_clip_max": clip_max})
    config, _, _ = prepare(raw, autoload=False)
    o = config.algo.policy_loss
    _, old, rollout, _, mask = inputs(4)
    # sequence ratios from exp(-1.2) to exp(1.2), token ratios around 1: some inside the band, some out
    shift = torch.linspace(-1.2, 1.2, len(old), dtype=old.dtype)[:, None] * mask / mask.sum(-1, keepdim=True)
    rollout = old - shift + 0.1 * (rollout - old) * mask
    weights, metrics = importance_weights(old, rollout, mask, o.mismatch, o.mismatch_low, o.mismatch_high, o.tis_floor)
    ratio = trl_is_ratio(old, rollout, mask, mode, clip_min, clip_max)
    torch.testing.assert_close(weights, ratio.expand_as(mask) * mask, rtol=1e-9, atol=1e-12)
    if mode.endswith("mask") and clip_max is not None:
        assert 0 < float(metrics["mismatch/dropped_frac"]) < 1
    flat = ratio.flatten() if mode.startswith("sequence") else ratio[mask.bool()]  # TRL's flat_is_ratio
    delta = (old - rollout).abs()[mask.bool()]
    theirs = {"abs_log_ratio": delta.mean(), "abs_log_ratio_max": delta.max(), "weight_min": flat.min(),
              "weight_mean": flat.mean(), "weight_max": flat.max()}
    for name, value in theirs.items():
        assert float(metrics[f"mismatch/{name}"]) == pytest.approx(float(value), rel=1e-9, abs=1e-12), name
    assert len({float(v) for v in theirs.values()}) == 5  # five different figures: nothing compared with itself


def test_trls_deprecated_cap_is_the_upper_bound():
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    raw, _ = from_grpo_fields({"use_vllm": True, "vllm_importance_sampling_cap": 5.0})
    assert raw["algo"]["policy_loss"]["mismatch_high"] == 5.0
    raw, _ = from_grpo_fields({"use_vllm": False})
    assert "mismatch" not in raw["algo"]["policy_loss"]


@pytest.mark.parametrize("mismatch", ["none", "tis", "icepop"])
@pytest.mark.parametrize("seed", [0, 1])
def test_vespo_is_trls_gamma_weighted_reinforce(seed, mismatch):
    """Against TRL's own ``GRPOTrainer.get_gamma_weights``: ``-phi * A * log pi`` over the tokens (TRL's
    token normaliser), with a token mismatch correction inside phi and not multiplying the loss again."""
    from trl import GRPOTrainer

    from rlhf_plugins.algorithms.mismatch import importance_weights

    logprobs, old, rollout, advantages, mask = inputs(seed)
    old = logprobs + 0.05 * (old - logprobs)  # sequence weights of order 1 (phi neither 0 nor 1)
    rollout = old + 0.05 * (rollout - old)
    band = {"mismatch_low": 0.9, "mismatch_high": 1.05}
    loss, grad, metrics = ours("vespo", logprobs, old, advantages, mask, rollout, mismatch=mismatch, **band)
    ratio = None
    if mismatch != "none":
        o = options(mismatch=mismatch, **band)
        ratio, _ = importance_weights(old, rollout, mask, mismatch, o.mismatch_low, o.mismatch_high, o.tis_floor)
        ratio = ratio + (1 - mask)  # TRL's ratio is 1 on padding (a zero log-prob difference)
    phi = GRPOTrainer.get_gamma_weights(advantages[:, :1], logprobs - old, mask, ratio)
    lp = logprobs.clone().requires_grad_(True)
    their_loss, their_grad = token_mean(-phi * advantages * lp, lp, mask)
    assert loss == pytest.approx(their_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, their_grad, rtol=1e-9, atol=1e-12)
    phi_mean = float((phi.expand_as(mask) * mask).sum() / mask.sum())
    assert float(metrics["loss/vespo_phi_mean"]) == pytest.approx(phi_mean) and abs(phi_mean - 1) > 0.005


def trl_nan_extreme(values: torch.Tensor, largest: bool) -> float:
    """TRL's nanmin / nanmax: the extreme of the values that are not NaN."""
    kept = [v for v in values.tolist() if not math.isnan(v)]
    return max(kept) if largest else min(kept)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_clips_extremes_over_sequences_are_trls_low_min_and_high_max(seed):
    """TRL 1.16's GRPO clip_ratio/low_min and /high_max: nanmin and nanmax over the micro batch's sequences of
    each one's share of tokens clipped below the band with a negative advantage (above it with a positive);
    a sequence of no tokens -- TRL's 0/0, a NaN -- is left out."""
    logprobs, old, _, advantages, mask = inputs(seed)
    mask[2] = 0  # a completion of no tokens
    advantages = advantages * mask
    _, _, metrics = ours("ppo", logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    coef_1 = torch.exp(logprobs - old)
    with torch.no_grad():
        low = ((coef_1 < 0.8) & (advantages < 0)).double()
        high = ((coef_1 > 1.28) & (advantages > 0)).double()
        low_seq, high_seq = ((x * mask).sum(-1) / mask.sum(-1) for x in (low, high))  # TRL's masked_seq_mean
    assert math.isnan(float(low_seq[2]))
    assert float(metrics["loss/clip_low_seq_min"]) == pytest.approx(trl_nan_extreme(low_seq, False), abs=1e-12)
    assert float(metrics["loss/clip_high_seq_max"]) == pytest.approx(trl_nan_extreme(high_seq, True), abs=1e-12)
    # the extremes bound the token shares: nothing the min / max of a mean could not be
    assert float(metrics["loss/clip_low_seq_min"]) <= float(metrics["loss/clip_low_frac"])
    assert 0 < float(metrics["loss/clip_high_frac"]) < float(metrics["loss/clip_high_seq_max"]) <= 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspos_clip_shares_count_sequences_as_trls_sequence_level(seed):
    """TRL 1.16 with importance_sampling_level sequence (our gspo): one ratio per completion, the exp of its mean
    log ratio, so clip_ratio/* count completions (its global_masked_mean over a (B, 1) tensor), not tokens; low_min
    and high_max are the extremes of the completions' flags."""
    logprobs, old, _, advantages, mask = inputs(seed)
    old = logprobs + 3 * (old - logprobs)  # sequence ratios spread wide enough for the clip to act on some
    _, _, m = ours("gspo", logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    coef_1 = torch.exp(((logprobs - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
    adv = advantages[:, :1]  # TRL's advantages.unsqueeze(1): one per completion
    low, high = ((coef_1 < 0.8) & (adv < 0)).double(), ((coef_1 > 1.28) & (adv > 0)).double()
    theirs = {"loss/clip_low_frac": low.mean(), "loss/clip_high_frac": high.mean(),
              "loss/clip_frac": (low + high).mean(), "loss/clip_low_seq_min": low.min(),
              "loss/clip_high_seq_max": high.max()}
    for name, value in theirs.items():
        assert float(m[name]) == pytest.approx(float(value), abs=1e-12), name
    assert 0 < float(theirs["loss/clip_frac"]) < 1  # the clip acted on some completions, not all
    by_tokens = float((((coef_1 < 0.8) & (adv < 0)) | ((coef_1 > 1.28) & (adv > 0))).double().mul(mask).sum()
                      / mask.sum())
    assert by_tokens != pytest.approx(float(theirs["loss/clip_frac"]), abs=1e-6)  # counting tokens would differ


def test_the_drop_ins_clip_names_follow_the_loss_as_trls_do():
    """log_history names the clip's shares as TRL does for the loss that ran: ``clip_ratio/*_mean`` for the
    clipped surrogate (below the band, above it, either) with ``low_min`` / ``high_max``, ``cispo_clip_ratio`` for
    CISPO's cap."""
    from rlhf_plugins.integrations.trl_state import _trl_row

    clipped = _trl_row({"loss/clip_frac": 0.3, "loss/clip_low_frac": 0.1, "loss/clip_high_frac": 0.2,
                        "loss/clip_low_seq_min": 0.0, "loss/clip_high_seq_max": 0.5})
    assert (clipped["clip_ratio/low_mean"], clipped["clip_ratio/high_mean"], clipped["clip_ratio/region_mean"]) == \
        (0.1, 0.2, 0.3) and "cispo_clip_ratio" not in clipped
    assert (clipped["clip_ratio/low_min"], clipped["clip_ratio/high_max"]) == (0.0, 0.5)
    capped = _trl_row({"loss/clip_frac": 0.3, "loss/clip_high_frac": 0.2})
    assert capped["cispo_clip_ratio"] == 0.2 and not any(k.startswith("clip_ratio/") for k in capped)
