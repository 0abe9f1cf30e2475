"""Estimators, KL and losses against straightforward per-sample Python loops on
random ragged inputs, plus hand-computed cases and properties."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlhf_plugins.algorithms import advantages as A
from rlhf_plugins.algorithms import kl as K
from rlhf_plugins.algorithms import numerics as N
from rlhf_plugins.algorithms import policy_losses as L
from rlhf_plugins.algorithms.numerics import aggregate, micro_batch_weight


def ragged(prompts=4, group=3, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = prompts * group
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    scores = torch.randn(B, generator=g)
    values = torch.randn(B, T, generator=g) * mask
    kl = torch.rand(B, T, generator=g) * 0.1 * mask
    return SimpleNamespace(B=B, T=T, group=group, lengths=lengths.tolist(), mask=mask, scores=scores,
                           values=values, kl=kl, g=g)


def inputs(r, **kw):
    return A.AdvantageInputs(scores=r.scores, action_mask=r.mask, group_size=r.group, **kw)


def whiten_loop(rows):
    flat = [x for row in rows for x in row]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def centre_loop(rows):
    """The batch mean subtracted alone (OpenRLHF's --no_advantage_std_norm)."""
    flat = [x for row in rows for x in row]
    mean = sum(flat) / len(flat)
    return [[x - mean for x in row] for row in rows]


def check_rows(tensor, rows, lengths, tol=1e-5):
    for i, row in enumerate(rows):
        assert tensor[i, : lengths[i]].tolist() == pytest.approx(row, abs=tol)
        assert float(tensor[i, lengths[i]:].abs().sum()) == 0.0  # nothing past the completion


def token_rewards_loop(r, i, kl=None):
    n = r.lengths[i]
    rew = [0.0] * n
    rew[-1] += float(r.scores[i])
    if kl is not None:
        rew = [rew[t] - float(kl[i, t]) for t in range(n)]
    return rew


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_loop(seed):
    r = ragged(seed=seed)
    gamma, lam = 0.9, 0.8
    adv, ret = A.gae(inputs(r, gamma=gamma, lam=lam, values=r.values, kl_penalty=r.kl))
    raw_adv, raw_ret = [], []
    for i in range(r.B):
        n = r.lengths[i]
        rew = token_rewards_loop(r, i, r.kl)
        v = [float(r.values[i, t]) for t in range(n)] + [0.0]
        a, out = 0.0, [0.0] * n
        for t in reversed(range(n)):
            delta = rew[t] + gamma * v[t + 1] - v[t]
            a = delta + gamma * lam * a
            out[t] = a
        raw_adv.append(out)
        raw_ret.append([out[t] + v[t] for t in range(n)])
    check_rows(ret, raw_ret, r.lengths)
    check_rows(adv, whiten_loop(raw_adv), r.lengths)
    centred, _ = A.gae(inputs(r, gamma=gamma, lam=lam, values=r.values, kl_penalty=r.kl, std_norm=False))
    check_rows(centred, centre_loop(raw_adv), r.lengths)


@pytest.mark.parametrize("seed", [0, 3])
def test_reinforce_matches_loop(seed):
    r = ragged(seed=seed)
    adv, ret = A.reinforce(inputs(r, gamma=0.95, kl_penalty=r.kl))
    rows = []
    for i in range(r.B):
        rew = token_rewards_loop(r, i, r.kl)
        g, out = 0.0, [0.0] * len(rew)
        for t in reversed(range(len(rew))):
            g = rew[t] + 0.95 * g
            out[t] = g
        rows.append(out)
    check_rows(ret, rows, r.lengths)
    check_rows(adv, whiten_loop(rows), r.lengths)
    centred, _ = A.reinforce(inputs(r, gamma=0.95, kl_penalty=r.kl, std_norm=False))
    check_rows(centred, centre_loop(rows), r.lengths)


def test_reinforce_baseline_matches_loop():
    r = ragged(seed=5)
    adv, _ = A.reinforce_baseline(inputs(r, kl_penalty=r.kl))
    rows = []
    for i in range(r.B):
        grp = range((i // r.group) * r.group, (i // r.group + 1) * r.group)
        base = sum(float(r.scores[j]) for j in grp) / r.group
        n = r.lengths[i]
        rew = [-float(r.kl[i, t]) for t in range(n)]
        rew[-1] += float(r.scores[i]) - base
        rows.append([sum(rew[t:]) for t in range(n)])
    check_rows(adv, whiten_loop(rows), r.lengths)
    centred, _ = A.reinforce_baseline(inputs(r, kl_penalty=r.kl, std_norm=False))
    check_rows(centred, centre_loop(rows), r.lengths)


def _group(r, i):
    return [float(r.scores[j]) for j in range((i // r.group) * r.group, (i // r.group + 1) * r.group)]


@pytest.mark.parametrize("seed", [0, 4])
def test_group_mean_batch_std_is_trls_batch_scaling(seed):
    """TRL's scale_rewards="batch", as its GRPOTrainer computes it (with TRL's own nanstd): the group mean
    subtracted, divided by the std of every score of the batch plus 1e-4; the same on every token."""
    pytest.importorskip("trl")
    from trl.trainer.utils import nanstd

    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    assert from_grpo_fields({"scale_rewards": "batch"})[0]["algo"]["advantage"]["estimator"] == "group_mean_batch_std"
    r = ragged(seed=seed)
    adv, ret = A.group_mean_batch_std(inputs(r))
    rewards = r.scores.double()
    mean_grouped = rewards.view(-1, r.group).mean(dim=1).repeat_interleave(r.group)
    theirs = (rewards - mean_grouped) / (nanstd(rewards) + 1e-4)
    check_rows(adv, [[float(theirs[i])] * r.lengths[i] for i in range(r.B)], r.lengths)
    assert torch.equal(adv, ret)
    group_std = rewards.view(-1, r.group).std(dim=1).repeat_interleave(r.group)
    assert not torch.allclose(theirs, (rewards - mean_grouped) / (group_std + 1e-4))  # not the group's std


@pytest.mark.parametrize("framework", ["openrlhf", "trl"])
def test_group_norm_adds_the_converted_frameworks_eps_to_the_std(framework):
    """Groups of nearly equal scores (group std ~1e-5, a reward model's rounding): the eps added to the std
    decides the advantages' scale. A converted OpenRLHF command divides by std + 1e-9 and a TRL config by
    std + 1e-4, as each computes it (TRL with its own nanstd); our default is 1e-6."""
    from rlhf_plugins.commands.convert import convert
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    if framework == "trl":
        pytest.importorskip("trl")
        from trl.trainer.utils import nanstd

        advantage = from_grpo_fields({"scale_rewards": "group"})[0]["algo"]["advantage"]
        eps, std = 1e-4, lambda x: nanstd(x, dim=1)
    else:
        advantage = convert(["--pretrain", "m", "--advantage_estimator", "group_norm"]).raw["algo"]["advantage"]
        eps, std = 1e-9, lambda x: x.std(-1)
    assert advantage == {**advantage, "estimator": "group_norm", "std_eps": eps}
    g = torch.Generator().manual_seed(3)
    scores = (0.5 + torch.randn(4, 4, generator=g, dtype=torch.float64) * 1e-5).reshape(-1)
    mask = torch.ones(16, 3, dtype=torch.float64)
    ours, _ = A.group_norm(A.AdvantageInputs(scores, mask, 4, std_eps=advantage["std_eps"]))
    grouped = scores.view(4, 4)
    theirs = ((grouped - grouped.mean(-1, keepdim=True)) / (std(grouped)[:, None] + eps)).reshape(-1)
    torch.testing.assert_close(ours[:, 0], theirs, rtol=1e-7, atol=0)
    default, _ = A.group_norm(A.AdvantageInputs(scores, mask, 4))
    assert (default[:, 0] - theirs).abs().max() > 0.05  # the default eps gives other advantages here


@pytest.mark.parametrize("seed", [0, 7])
def test_group_estimators_match_loops(seed):
    r = ragged(prompts=5, group=4, seed=seed)
    gn, _ = A.group_norm(inputs(r))
    dr, _ = A.dr_grpo(inputs(r))
    lo, _ = A.rloo(inputs(r))
    for i in range(r.B):
        grp = _group(r, i)
        s = float(r.scores[i])
        mean = sum(grp) / len(grp)
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (len(grp) - 1))
        loo = (sum(grp) - s) / (len(grp) - 1)
        n = r.lengths[i]
        assert gn[i, :n].tolist() == pytest.approx([(s - mean) / (std + 1e-6)] * n, abs=1e-5)
        assert dr[i, :n].tolist() == pytest.approx([s - mean] * n, abs=1e-6)
        assert lo[i, :n].tolist() == pytest.approx([s - loo] * n, abs=1e-6)
        assert float(gn[i, n:].abs().sum()) == 0.0


def test_batch_mean_is_flash_reinforces_baseline():
    """FlashREINFORCE's advantage (TRL's FlashREINFORCETrainer: rewards - rewards.mean() over the batch; verl's and
    OpenRLHF's flash_reinforce): one sample per prompt, the batch's mean subtracted, no std; with KL in the reward
    the KL still to come is subtracted per token, as for the group estimators."""
    r = ragged(prompts=12, group=1, seed=8)
    adv, ret = A.batch_mean(inputs(r))
    mean = sum(float(s) for s in r.scores) / r.B
    check_rows(adv, [[float(r.scores[i]) - mean] * r.lengths[i] for i in range(r.B)], r.lengths)
    assert torch.equal(adv, ret)
    shaped, _ = A.batch_mean(inputs(r, kl_penalty=r.kl))
    rows = []
    for i in range(r.B):
        n = r.lengths[i]
        rows.append([float(r.scores[i]) - mean - sum(float(r.kl[i, u]) for u in range(t, n)) for t in range(n)])
    check_rows(shaped, rows, r.lengths)


def test_group_properties():
    r = ragged(prompts=6, group=5, seed=11)
    gn, _ = A.group_norm(inputs(r))
    per_seq = gn[:, 0].view(-1, r.group)
    assert per_seq.mean(-1).abs().max() < 1e-5  # zero mean per group
    # RLOO's baseline excludes the sample itself: changing sample 0's score moves its advantage 1:1
    lo, _ = A.rloo(inputs(r))
    r2 = ragged(prompts=6, group=5, seed=11)
    r2.scores = r.scores.clone()
    r2.scores[0] += 1.0
    lo2, _ = A.rloo(inputs(r2))
    assert float(lo2[0, 0] - lo[0, 0]) == pytest.approx(1.0, abs=1e-6)
    assert float(lo2[1, 0] - lo[1, 0]) == pytest.approx(-1.0 / (r.group - 1), abs=1e-6)


def test_hand_computed_grpo_and_rloo():
    mask = torch.ones(4, 1)
    x = A.AdvantageInputs(scores=torch.tensor([1.0, 0.0, 0.0, 1.0]), action_mask=mask, group_size=2)
    gn, _ = A.group_norm(x)
    # group (1, 0): mean 0.5, unbiased std 0.7071 -> +-0.7071
    assert gn[:, 0].tolist() == pytest.approx([0.70710, -0.70710, -0.70710, 0.70710], abs=1e-4)
    lo, _ = A.rloo(x)
    assert lo[:, 0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])


def test_gae_hand_computed():
    # one sequence of 2 tokens, reward 1 at the end, values (0.5, 0.25), gamma 1, lambda 1:
    # delta_1 = 1 - 0.25 = 0.75, delta_0 = 0 + 0.25 - 0.5 = -0.25, A_0 = 0.5, A_1 = 0.75; returns = 1, 1
    x = A.AdvantageInputs(scores=torch.tensor([1.0]), action_mask=torch.ones(1, 2), gamma=1.0, lam=1.0,
                          values=torch.tensor([[0.5, 0.25]]))
    adv, ret = A.gae(x)
    assert ret[0].tolist() == pytest.approx([1.0, 1.0])
    # raw advantages (0.5, 0.75) whitened: mean 0.625, unbiased std 0.1768
    assert adv[0].tolist() == pytest.approx([-0.70710, 0.70710], abs=1e-4)


def test_kl_estimators():
    g = torch.Generator().manual_seed(0)
    lp, ref = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)
    for i in range(5):
        for t in range(6):
            d = float(lp[i, t] - ref[i, t])
            assert float(K.k1(lp, ref)[i, t]) == pytest.approx(d, abs=1e-6)
            assert float(K.k2(lp, ref)[i, t]) == pytest.approx(0.5 * d * d, abs=1e-6)
            k3 = min(math.exp(-d) - 1 + d, 10.0)  # clamped at 10 for stability
            assert float(K.k3(lp, ref)[i, t]) == pytest.approx(k3, rel=1e-5, abs=1e-6)
    assert float(K.k3(lp, lp).abs().max()) == 0.0
    assert float(K.k3(torch.tensor([0.0]), torch.tensor([100.0]))) <= 10.0  # clamped
    # k3 is an unbiased estimate of KL(p||q): check by sampling from p
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.4, 0.4, 0.2])
    exact = float((p * (p / q).log()).sum())
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    est = K.k3(p.log()[x], q.log()[x]).mean()
    assert float(est) == pytest.approx(exact, abs=5e-3)


def opts(**kw):
    base = dict(clip_low=0.2, clip_high=0.28, dual_clip=None, aggregation="token-mean", entropy_coef=0.0)
    base.update(kw)
    return SimpleNamespace(**base)


def ppo_loop(lp, old, adv, o):
    ratio = math.exp(lp - old)
    s1 = ratio * adv
    s2 = min(max(ratio, 1 - o.clip_low), 1 + o.clip_high) * adv
    loss = -min(s1, s2)
    if o.dual_clip is not None and adv < 0:
        loss = min(loss, -o.dual_clip * adv)
    return loss


@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_matches_loop(dual):
    r = ragged(seed=4)
    g = r.g
    lp = torch.randn(r.B, r.T, generator=g) * 0.5
    old = lp + torch.randn(r.B, r.T, generator=g)  # ratios from 0.1 to 10: both clips and the dual clip act
    adv = torch.randn(r.B, r.T, generator=g) * 2
    o = opts(dual_clip=dual)
    loss, m = L.ppo(L.PolicyLossInputs(lp, old, adv, r.mask), o)
    clipped, low, high, dual_bound, tokens = 0, 0, 0, 0, 0
    for i in range(r.B):
        for t in range(r.lengths[i]):
            a, b, A = float(lp[i, t]), float(old[i, t]), float(adv[i, t])
            assert float(loss[i, t]) == pytest.approx(ppo_loop(a, b, A, o), rel=1e-5, abs=1e-6)
            ratio = math.exp(a - b)
            clipped += min(max(ratio, 1 - o.clip_low), 1 + o.clip_high) * A < ratio * A  # the clip decided
            low += ratio < 1 - o.clip_low and A < 0  # TRL's is_low_clipped / is_high_clipped
            high += ratio > 1 + o.clip_high and A > 0
            dual_bound += dual is not None and A < 0 and ppo_loop(a, b, A, opts()) > -dual * A
            tokens += 1
    # the logged fractions are the loop's, token by token (low and high: TRL's clip_ratio/low_mean, /high_mean)
    assert 0.1 < clipped / tokens < 0.9 and low > 0 and high > 0
    assert float(m["loss/clip_frac"]) == pytest.approx(clipped / tokens, abs=1e-6)
    assert float(m["loss/clip_low_frac"]) == pytest.approx(low / tokens, abs=1e-6)
    assert float(m["loss/clip_high_frac"]) == pytest.approx(high / tokens, abs=1e-6)
    if dual is not None:
        assert 0 < dual_bound and float(m["loss/dual_clip_frac"]) == pytest.approx(dual_bound / tokens, abs=1e-6)


def test_trls_two_sided_delta_clip_converts_to_the_same_loss_for_every_delta_above_one():
    """TRL's ``delta`` (INTELLECT-2): ``-min(min(r, delta) A, clip(r) A)``, written as TRL does, equals our
    PPO loss under the clip settings its conversion gives, in value and gradient -- the dual clip c = delta
    above 1 + epsilon_high, a tighter clip_high with the dual clip at 1 + epsilon_high from 1 up to there."""
    pytest.importorskip("trl")
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    r = ragged(seed=9)
    lp = torch.randn(r.B, r.T, generator=r.g) * 0.5
    old = lp.detach() + torch.randn(r.B, r.T, generator=r.g) * 1.5
    adv = torch.randn(r.B, r.T, generator=r.g) * 2
    for delta in (1.05, 1.2, 1.28, 1.3, 2.0, 4.0):
        clip = from_grpo_fields({"delta": delta, "epsilon": 0.2, "epsilon_high": 0.28})[0]["algo"]["policy_loss"]
        ours_lp, theirs_lp = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
        o = opts(clip_high=clip["clip_high"], dual_clip=clip["dual_clip"])
        ours, _ = L.ppo(L.PolicyLossInputs(ours_lp, old, adv, r.mask), o)
        ratio = torch.exp(theirs_lp - old)
        theirs = -torch.min(torch.clamp(ratio, max=delta) * adv, torch.clamp(ratio, 1 - 0.2, 1 + 0.28) * adv)
        mask = r.mask.bool()
        assert torch.allclose(ours[mask], theirs[mask], rtol=1e-5, atol=1e-6), delta
        (ours * r.mask).sum().backward()
        (theirs * r.mask).sum().backward()
        assert torch.allclose(ours_lp.grad, theirs_lp.grad, rtol=1e-5, atol=1e-6), delta
        assert (ratio[mask] > delta).any()  # the bound acted
        assert ((ratio[mask] > delta) & (adv[mask] > 0)).any() and ((ratio[mask] > 1.28) & (adv[mask] < 0)).any()


def test_clipping_bounds_the_ratio_and_dual_clip_only_on_negative_advantages():
    ratios = torch.linspace(0.1, 10, 50)[None, :]
    lp, old = ratios.log(), torch.zeros_like(ratios)
    mask = torch.ones_like(ratios)
    pos = torch.ones_like(ratios)
    loss, _ = L.ppo(L.PolicyLossInputs(lp, old, pos, mask), opts())
    # with A > 0 the objective never credits a ratio above 1 + clip_high
    assert float((-loss).max()) == pytest.approx(1.28, abs=1e-6)
    loss_plain, _ = L.ppo(L.PolicyLossInputs(lp, old, pos, mask), opts())
    loss_dual, _ = L.ppo(L.PolicyLossInputs(lp, old, pos, mask), opts(dual_clip=3.0))
    assert torch.equal(loss_plain, loss_dual)  # positive advantages untouched
    neg = -torch.ones_like(ratios)
    loss_neg, _ = L.ppo(L.PolicyLossInputs(lp, old, neg, mask), opts(dual_clip=3.0))
    assert float(loss_neg.max()) == pytest.approx(3.0)  # bounded by -c * A
    # gradient through a clipped token is zero
    lp_req = lp.clone().requires_grad_(True)
    L.ppo(L.PolicyLossInputs(lp_req, old, pos, mask), opts())[0].sum().backward()
    clipped = ratios[0] > 1.28
    assert float(lp_req.grad[0, clipped].abs().sum()) == 0.0
    assert float(lp_req.grad[0, ~clipped].abs().sum()) > 0.0


def test_gspo_uses_the_sequence_ratio():
    r = ragged(seed=9)
    lp = torch.randn(r.B, r.T, generator=r.g) * 0.1
    old = lp + torch.randn(r.B, r.T, generator=r.g) * 0.1
    adv = torch.randn(r.B, 1, generator=r.g).expand(r.B, r.T) * r.mask
    o = opts(clip_low=3e-3, clip_high=4e-3)
    loss, _ = L.gspo(L.PolicyLossInputs(lp, old, adv, r.mask), o)
    for i in range(r.B):
        n = r.lengths[i]
        s = math.exp(sum(float(lp[i, t] - old[i, t]) for t in range(n)) / n)
        expected = ppo_loop(math.log(s), 0.0, float(adv[i, 0]), o)
        assert loss[i, :n].tolist() == pytest.approx([expected] * n, rel=1e-4, abs=1e-6)


def test_aggregation_modes_match_loops():
    r = ragged(seed=12)
    x = torch.randn(r.B, r.T, generator=r.g)
    toks = [[float(x[i, t]) for t in range(r.lengths[i])] for i in range(r.B)]
    flat = [v for row in toks for v in row]
    assert float(aggregate(x, r.mask, "token-mean")) == pytest.approx(sum(flat) / len(flat), abs=1e-5)
    assert float(aggregate(x, r.mask, "seq-mean-token-mean")) == pytest.approx(
        sum(sum(row) / len(row) for row in toks) / r.B, abs=1e-5)
    assert float(aggregate(x, r.mask, "seq-mean-token-sum")) == pytest.approx(
        sum(sum(row) for row in toks) / r.B, abs=1e-5)
    assert float(aggregate(x, r.mask, "seq-mean-token-sum-norm", norm=16)) == pytest.approx(
        sum(sum(row) / 16 for row in toks) / r.B, abs=1e-5)
    with pytest.raises(ValueError, match="unknown loss aggregation 'x'"):
        aggregate(x, r.mask, "x")
    with pytest.raises(ValueError, match="needs a constant length norm"):
        aggregate(x, r.mask, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_weights_reproduce_the_full_batch(mode):
    r = ragged(prompts=4, group=3, seed=13)
    x = torch.randn(r.B, r.T, generator=r.g)
    r.mask[2] = 0.0  # an empty completion: counts in no sequence mean
    full = float(aggregate(x, r.mask, mode, norm=9))
    parts = 0.0
    for s in range(0, r.B, 5):
        m = r.mask[s : s + 5]
        parts += float(aggregate(x[s : s + 5], m, mode, norm=9)) * micro_batch_weight(m, r.mask, mode)
    assert parts == pytest.approx(full, abs=1e-5)


# --- mismatch correction, value loss, KL control, shaping ------------------------------------

from rlhf_plugins.algorithms.kl_control import AdaptiveKLController, FixedKLController  # noqa: E402
from rlhf_plugins.algorithms.mismatch import importance_weights  # noqa: E402
from rlhf_plugins.algorithms.shaping import RewardShaper, RunningMoments, keep_groups  # noqa: E402
from rlhf_plugins.algorithms.value import clipped_value_loss  # noqa: E402


@pytest.mark.parametrize("mode", ["tis", "icepop", "seq_icepop", "seq_mask_tis"])
def test_mismatch_weights_match_loop(mode):
    r = ragged(seed=21)
    old = torch.randn(r.B, r.T, generator=r.g) * 0.3
    roll = old + torch.randn(r.B, r.T, generator=r.g) * 0.5
    low, high = 0.7, 1.5
    w, m = importance_weights(old, roll, r.mask, mode, low, high)
    for i in range(r.B):
        n = r.lengths[i]
        ratios = [math.exp(float(old[i, t] - roll[i, t])) for t in range(n)]
        if mode == "tis":
            expect = [min(x, high) for x in ratios]
        elif mode == "icepop":
            expect = [x if low <= x <= high else 0.0 for x in ratios]
        else:
            seq = math.exp(sum(float(old[i, t] - roll[i, t]) for t in range(n)) / n)
            keep = low <= seq <= high
            expect = [(min(x, high) if mode == "seq_mask_tis" else x) if keep else 0.0 for x in ratios]
        assert w[i, :n].tolist() == pytest.approx(expect, rel=1e-5, abs=1e-6)
        assert float(w[i, n:].abs().sum()) == 0.0
    assert 0.0 <= float(m["mismatch/dropped_frac"]) <= 1.0
    # identical policies: every weight is 1
    same, _ = importance_weights(old, old, r.mask, mode, low, high)
    assert torch.equal(same, r.mask)


@pytest.mark.parametrize("mode", ["icepop", "seq_icepop"])
@pytest.mark.parametrize("gate", ["binary_kl", "tv"])
def test_mismatch_divergence_gates_match_loop(mode, gate):
    """icepop / seq_icepop gated on the sampled token's binary KL or total variation between the engine's
    probability p and the learner's q: kept tokens (or every token of a kept sequence) weigh their raw ratio."""
    r = ragged(seed=22)
    old = torch.rand(r.B, r.T, generator=r.g).clamp(0.05, 0.95).log()
    spread = torch.rand(r.B, 1, generator=r.g) * 0.4  # some sequences close to the learner, some far
    roll = (old + torch.randn(r.B, r.T, generator=r.g) * spread).clamp(max=0.0)
    limit = 0.01 if gate == "binary_kl" else 0.05
    w, m = importance_weights(old, roll, r.mask, mode, 0.5, 2.0, gate=gate, max_divergence=limit)

    def divergence(i, t):
        p = min(max(math.exp(float(roll[i, t])), 1e-6), 1 - 1e-6)
        q = min(max(math.exp(float(old[i, t])), 1e-6), 1 - 1e-6)
        if gate == "tv":
            return abs(p - q)
        return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))

    dropped = dropped_rows = 0
    for i in range(r.B):
        n = r.lengths[i]
        per_token = [divergence(i, t) for t in range(n)]
        kept = [d <= limit for d in per_token] if mode == "icepop" else [sum(per_token) / n <= limit] * n
        expect = [math.exp(float(old[i, t] - roll[i, t])) if kept[t] else 0.0 for t in range(n)]
        assert w[i, :n].tolist() == pytest.approx(expect, rel=1e-5, abs=1e-6)
        dropped += n - sum(kept)
        dropped_rows += not any(kept)
    assert 0 < dropped < sum(r.lengths)  # the gate acted, and not on everything
    assert float(m["mismatch/dropped_frac"]) == pytest.approx(dropped / sum(r.lengths))
    if mode == "seq_icepop":  # the share of whole sequences dropped
        assert float(m["mismatch/dropped_seq_frac"]) == pytest.approx(dropped_rows / r.B)
    else:
        assert "mismatch/dropped_seq_frac" not in m


def test_value_loss_matches_loop():
    g = torch.Generator().manual_seed(3)
    v, old, ret = (torch.randn(4, 5, generator=g) for _ in range(3))
    for clip in (None, 0.2):
        loss = clipped_value_loss(v, old, ret, clip)
        for i in range(4):
            for t in range(5):
                a = (float(v[i, t]) - float(ret[i, t])) ** 2
                if clip is not None:
                    vc = float(old[i, t]) + min(max(float(v[i, t] - old[i, t]), -clip), clip)
                    a = max(a, (vc - float(ret[i, t])) ** 2)
                assert float(loss[i, t]) == pytest.approx(0.5 * a, rel=1e-5)


def test_adaptive_kl_controller_hand_computed():
    c = AdaptiveKLController(0.1, target=0.05, horizon=1000)
    c.update(0.1, n_samples=100)  # error clipped to +0.2 -> x(1 + 0.2 * 0.1)
    assert c.value == pytest.approx(0.1 * 1.02)
    c.update(0.045, n_samples=100)  # error -0.1 -> x(1 - 0.01)
    assert c.value == pytest.approx(0.1 * 1.02 * 0.99)
    restored = AdaptiveKLController(0.5, 0.05, 1000)
    restored.load_state_dict(c.state_dict())
    assert restored.value == c.value
    fixed = FixedKLController(0.3)
    fixed.update(10.0, 100)
    assert fixed.value == 0.3


def shaping(**kw):
    base = dict(stop_penalty=0.0, overlong_buffer=0, overlong_penalty=1.0, normalize=False, clip=None,
                truncated_scale=None, clip_low=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_overlong_and_stop_penalties_hand_computed():
    s = RewardShaper(shaping(overlong_buffer=4, overlong_penalty=0.5, stop_penalty=0.25), max_new_tokens=10)
    # start of the buffer = 6: lengths 6 -> 0, 8 -> (6 - 8) / 4 * 0.5 = -0.25, 10 -> -0.5 (and not stopped: -0.25)
    out = s([1.0, 1.0, 1.0], [6, 8, 10], ["stop", "stop", "length"])
    assert out == pytest.approx([1.0, 0.75, 0.25])


def openrlhf_shaped(score, length, truncated, max_new_tokens, buffer, factor, coef):
    """OpenRLHF's DAPO overlong penalty, then its ProRL stop-properly penalty, as its experience maker
    applies them: the excess over ``max_new_tokens - buffer`` (capped at the buffer) costs up to
    ``factor``; a truncated sample's reward is then scaled by ``coef`` (or replaced by it when negative)."""
    exceed = min(length - (max_new_tokens - buffer), buffer)
    if exceed > 0:
        score += -exceed / buffer * factor
    if truncated:
        score = score * coef if coef >= 0 else coef
    return score


@pytest.mark.parametrize("coef", [0.0, 0.5, 1.0, -0.5])
def test_truncated_scale_is_openrlhfs_stop_properly_penalty(coef):
    s = RewardShaper(shaping(overlong_buffer=4, overlong_penalty=0.5, truncated_scale=coef), max_new_tokens=10)
    scores, lengths = [1.0, 0.8, 0.3, 1.0], [5, 8, 10, 10]
    reasons = ["stop", "stop", "length", "stop"]
    want = [openrlhf_shaped(x, n, r == "length", 10, 4, 0.5, coef) for x, n, r in zip(scores, lengths, reasons)]
    assert s(scores, lengths, reasons) == pytest.approx(want)
    assert s([1.0], [10], ["length"]) == pytest.approx([{0.0: 0.0, 0.5: 0.25, 1.0: 0.5, -0.5: -0.5}[coef]])


def test_an_asymmetric_clip_is_openrlhfs_reward_clip_range():
    """OpenRLHF clamps rewards to --reward_clip_range LOW HIGH: ``--reward.clip_low LOW --reward.clip HIGH``."""
    from rlhf_plugins.commands.convert import convert

    reward = convert(["--pretrain", "m", "--reward_clip_range", "0", "1"]).raw["reward"]
    assert (reward["clip_low"], reward["clip"]) == (0, 1)
    s = RewardShaper(shaping(clip=reward["clip"], clip_low=reward["clip_low"]), max_new_tokens=4)
    scores = [-2.0, -0.5, 0.3, 0.9, 4.0]
    assert s(scores, [1] * 5, ["stop"] * 5) == [0.0, 0.0, 0.3, 0.9, 1.0]
    symmetric = RewardShaper(shaping(clip=1.0), max_new_tokens=4)
    assert symmetric(scores, [1] * 5, ["stop"] * 5) == [-1.0, -0.5, 0.3, 0.9, 1.0]


def test_normalisation_and_clip():
    import statistics

    s = RewardShaper(shaping(normalize=True, clip=1.0), max_new_tokens=4)
    first = [0.0, 1.0, 2.0, 3.0]
    second = [10.0, 0.0]
    s(first, [1] * 4, ["stop"] * 4)
    out = s(second, [1] * 2, ["stop"] * 2)
    seen = first + second
    mean, std = statistics.mean(seen), statistics.stdev(seen)
    assert out == pytest.approx([min(1.0, (10 - mean) / std), max(-1.0, (0 - mean) / std)], rel=1e-6)
    m = RunningMoments()
    for chunk in ([1.0, 2.0], [3.0], [4.0, 5.0, 6.0]):
        m.update(chunk)
    assert m.mean == pytest.approx(3.5) and m.std == pytest.approx(statistics.stdev([1, 2, 3, 4, 5, 6]))


def test_keep_groups():
    scores = [1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 1]
    assert keep_groups(scores, 3, None) == [1, 3]  # all-equal groups carry no signal
    # group 1 has mean 1/3, group 3 mean 2/3: a range (0.5, 1) keeps group 3 only
    assert keep_groups(scores, 3, [0.5, 1.0]) == [3]
    assert keep_groups([0, 1, 1, 1, 0, 1], 3, [0.0, 1.0]) == [0, 1]


# --- conventions of the numerics issue: constant norm, KL in the reward, outliers ----------------

from rlhf_plugins.algorithms.objective import Objective  # noqa: E402


def loss_opts(**kw):
    base = dict(clip_low=0.2, clip_high=0.2, dual_clip=None, aggregation="token-mean", entropy_coef=0.0,
                mismatch="none", mismatch_low=0.5, mismatch_high=2.0, tis_floor=0.0)
    base.update(kw)
    return SimpleNamespace(**base)


def pad_to(x, T):
    return torch.nn.functional.pad(x, (0, T - x.shape[1]))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_padding_width_changes_neither_loss_nor_gradient(mode):
    """The same tokens padded to T and to 3T: Dr. GRPO divides by the generation budget, never
    by the padded width of the rollout."""
    r = ragged(prompts=3, group=2, T=5, seed=31)
    lp0 = torch.randn(r.B, r.T, generator=r.g) * 0.3
    old0 = lp0 + torch.randn(r.B, r.T, generator=r.g) * 0.1
    adv0 = torch.randn(r.B, r.T, generator=r.g)
    results = []
    for width in (r.T, 3 * r.T):
        lp = pad_to(lp0, width).clone().requires_grad_(True)
        batch = {"action_mask": pad_to(r.mask, width), "old_logprobs": pad_to(old0, width),
                 "advantages": pad_to(adv0, width) * pad_to(r.mask, width)}
        obj = Objective(policy_loss=L.ppo, options=loss_opts(aggregation=mode), norm_length=16)
        loss, _ = obj({"logprobs": lp}, batch)
        loss.backward()
        results.append((float(loss.detach()), lp.grad[:, : r.T].clone(), float(lp.grad[:, r.T:].abs().sum())))
    (l1, g1, _), (l2, g2, rest) = results
    assert l1 == pytest.approx(l2, abs=1e-7)
    assert torch.allclose(g1, g2, atol=1e-8) and rest == 0.0


def test_empty_completions_do_not_count_in_sequence_means():
    x = torch.tensor([[1.0, 3.0], [5.0, 0.0], [7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    # sequences with tokens: row 0 (mean 2, sum 4) and row 2 (mean 7, sum 7)
    assert float(aggregate(x, mask, "seq-mean-token-mean")) == pytest.approx((2 + 7) / 2)
    assert float(aggregate(x, mask, "seq-mean-token-sum")) == pytest.approx((4 + 7) / 2)
    assert float(aggregate(x, mask, "seq-mean-token-sum-norm", norm=4)) == pytest.approx((4 / 4 + 7 / 4) / 2)
    assert float(aggregate(x, torch.zeros_like(mask), "seq-mean-token-mean")) == 0.0


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "rloo", "group_mean_batch_std"])
def test_equal_scores_with_kl_in_the_reward_get_advantages_bounded_by_the_kl(estimator):
    """Binary rewards often give a group equal scores: its advantages must come from the KL
    penalty alone (reward-to-go), not from KL noise divided by a tiny std."""
    r = ragged(prompts=3, group=4, T=6, seed=41)
    scores = torch.ones(r.B)
    kl = r.kl * 0.1  # a small penalty, already scaled by the coefficient
    adv, _ = getattr(A, estimator)(A.AdvantageInputs(scores, r.mask, r.group, kl_penalty=kl))
    for i in range(r.B):
        n = r.lengths[i]
        to_go = [-sum(float(kl[i, s]) for s in range(t, n)) for t in range(n)]
        assert adv[i, :n].tolist() == pytest.approx(to_go, abs=1e-6)
    assert float(adv.abs().max()) <= float((kl * r.mask).sum(-1).max()) + 1e-7
    # the old order amplifies the noise to O(1) advantages
    old, _ = getattr(A, estimator)(A.AdvantageInputs(scores, r.mask, r.group, kl_penalty=kl, kl_in_baseline=True))
    if estimator == "group_norm":
        assert float(old.abs().max()) > 0.5


@pytest.mark.parametrize("seed", [0, 5])
def test_group_advantages_with_kl_in_the_reward_match_a_loop(seed):
    r = ragged(prompts=4, group=3, seed=seed)
    adv, _ = A.group_norm(inputs(r, kl_penalty=r.kl))
    for i in range(r.B):
        grp = _group(r, i)
        mean = sum(grp) / len(grp)
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (len(grp) - 1))
        a = (float(r.scores[i]) - mean) / (std + 1e-6)
        n = r.lengths[i]
        expect = [a - sum(float(r.kl[i, s]) for s in range(t, n)) for t in range(n)]
        assert adv[i, :n].tolist() == pytest.approx(expect, abs=1e-5)
        assert float(adv[i, n:].abs().sum()) == 0.0


@pytest.mark.parametrize("loss_fn", [L.ppo, L.gspo])
def test_extreme_log_ratios_give_finite_loss_and_gradients(loss_fn):
    lp = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1000.0, 0.0, -25.0], [1000.0, 0.0, 0.0]])
    mask = torch.ones(2, 3)
    for sign in (1.0, -1.0):
        adv = torch.full((2, 3), sign)
        loss, m = loss_fn(L.PolicyLossInputs(lp, old, adv, mask), loss_opts())
        total = loss.mean()
        (grad,) = torch.autograd.grad(total, lp)
        assert math.isfinite(float(total.detach())) and bool(torch.isfinite(grad).all())
        assert float(loss.detach().abs().max()) <= math.exp(L.LOG_RATIO_CLAMP) * 1.0001
        assert float(m["loss/ratio_clamp_frac"]) > 0


def test_kl_estimators_are_clamped_to_one_convention():
    lp = torch.tensor([0.0, -50.0, 0.0, -3.0], requires_grad=True)
    ref = torch.tensor([-50.0, 0.0, -1e4, -3.0])
    for name in ("k1", "k2", "k3"):
        out = getattr(K, name)(lp, ref)
        (grad,) = torch.autograd.grad(out.sum(), lp)
        assert float(out.detach().abs().max()) <= K.CLAMP and bool(torch.isfinite(grad).all()), name
        assert float(out[3].detach()) == 0.0
    assert K.k1(lp, ref)[:2].tolist() == [10.0, -10.0]
    assert float(K.k3(lp, ref)[1].detach()) == 10.0  # log(q/p) = 50 is capped before exp: no overflow


def test_tis_floor_truncates_from_below():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    roll = torch.tensor([[math.log(10.0), 0.0, -math.log(4.0)]])  # ratios 0.1, 1, 4
    mask = torch.ones(1, 3)
    w, _ = importance_weights(old, roll, mask, "tis", 0.5, 2.0)
    assert w[0].tolist() == pytest.approx([0.1, 1.0, 2.0])
    w, _ = importance_weights(old, roll, mask, "tis", 0.5, 5.0, floor=0.5)  # OpenRLHF's band
    assert w[0].tolist() == pytest.approx([0.5, 1.0, 4.0])


def test_gspo_defaults_to_the_sequence_mean_and_dr_grpo_to_the_budget():
    from rlhf_plugins.api import prepare

    c, _, _ = prepare({"algo": {"policy_loss": {"name": "gspo"}}, "generation": {"max_new_tokens": 12}}, autoload=False)
    assert c.algo.policy_loss.aggregation == "seq-mean-token-mean"
    assert c.algo.policy_loss.norm_length == 12
    c, _, _ = prepare({"algo": {"policy_loss": {"name": "gspo", "aggregation": "token-mean", "norm_length": 64}}},
                      autoload=False)
    assert c.algo.policy_loss.aggregation == "token-mean" and c.algo.policy_loss.norm_length == 64
    c, _, _ = prepare({}, autoload=False)
    assert c.algo.policy_loss.aggregation == "token-mean"


def test_inverse_cdf_sampling_draws_the_categorical_distribution_and_never_a_filtered_token():
    """The transformers engine's sampler: token frequencies over many draws match the probabilities
    (5 binomial standard deviations), tokens removed by top-k have probability 0 and are never
    drawn, and the extreme uniforms land on the first and last tokens that can be drawn."""
    from rlhf_plugins.engines.transformers_engine import filter_logits, sample_from

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 12, generator=g) * 2
    probs = torch.softmax(filter_logits(logits, top_k=5, top_p=1.0), -1)
    n = 200_000
    for row in range(2):
        drawn = sample_from(probs[row].expand(n, -1), torch.rand(n, generator=g))
        freq = torch.bincount(drawn, minlength=12).double() / n
        p = probs[row].double()
        assert (freq[p == 0] == 0).all() and int((p > 0).sum()) == 5
        assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-12).all(), (freq, p)
        kept = (p > 0).nonzero().flatten()
        edges = sample_from(probs[row].expand(2, -1), torch.tensor([0.0, 1.0 - 1e-7]))
        assert edges.tolist() == [int(kept[0]), int(kept[-1])]


def test_top_entropy_quantile_trains_exactly_the_highest_entropy_tokens_of_the_micro_batch():
    """TRL's top_entropy_quantile: the policy loss keeps the tokens whose entropy is at least the
    (1 - q) quantile of the micro batch's token entropies, counted by a sort by hand; the KL and
    entropy terms are not masked."""
    r = ragged(prompts=3, group=2, T=9, seed=5)
    lp = (torch.randn(r.B, r.T, generator=r.g) * 0.3).requires_grad_(True)
    old = lp.detach() + torch.randn(r.B, r.T, generator=r.g) * 0.1
    adv = torch.randn(r.B, r.T, generator=r.g) * r.mask
    entropy = torch.rand(r.B, r.T, generator=r.g) * 3
    batch = {"action_mask": r.mask, "old_logprobs": old, "advantages": adv}
    obj = Objective(policy_loss=L.ppo, options=loss_opts(top_entropy_quantile=0.2))
    assert obj.needs_entropy
    loss, metrics = obj({"logprobs": lp, "entropy": entropy}, batch)
    loss.backward()
    values = sorted(float(e) for e, m in zip(entropy.flatten(), r.mask.flatten()) if m)
    n = len(values)
    pos = 0.8 * (n - 1)  # torch.quantile's linear interpolation, by hand
    threshold = values[int(pos)] + (values[min(int(pos) + 1, n - 1)] - values[int(pos)]) * (pos - int(pos))
    kept = (entropy >= threshold) & r.mask.bool()
    assert int(kept.sum()) == sum(v >= threshold for v in values) and 0 < int(kept.sum()) < n
    per_token, _ = L.ppo(L.PolicyLossInputs(lp.detach(), old, adv, r.mask), obj.options)
    assert float(loss.detach()) == pytest.approx(float((per_token * kept).sum() / r.mask.sum()), rel=1e-6)
    assert (lp.grad[~kept] == 0).all() and (lp.grad[kept] != 0).any()  # only the kept tokens learn
    assert float(metrics["loss/entropy_kept_frac"]) == pytest.approx(int(kept.sum()) / n)


def test_the_high_entropy_mask_follows_torch_quantile_on_random_masks_ties_and_empty_ones():
    """The mask computed without selecting the masked entropies (no host read of their count) keeps
    the tokens torch.quantile's rule over the selected values keeps: random shapes, masks, fractions,
    tied entropies, and an empty mask (nothing kept)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        B, T = torch.randint(1, 6, (2,), generator=g).tolist()
        entropy = torch.rand(B, T, generator=g) * 3
        if trial % 5 == 0:
            entropy = entropy.round()
        mask = (torch.rand(B, T, generator=g) > 0.4).float()
        top = float(torch.rand(1, generator=g)) * 0.99 + 0.005
        values = entropy[mask.bool()]
        want = (torch.zeros_like(mask) if values.numel() == 0
                else ((entropy >= torch.quantile(values, 1 - top)) & mask.bool()).float())
        assert torch.equal(N.high_entropy_mask(entropy, mask, top), want), trial
    assert not N.high_entropy_mask(torch.rand(2, 3), torch.zeros(2, 3), 0.5).any()
