"""Advantage estimators: rewards (and values) -> per-token advantages and returns.

Samples of one prompt are contiguous in the batch (``B = prompts * group_size``),
completions are right-padded and ``action_mask`` marks their tokens.

KL in the reward (``--algo.kl.in_reward``): group estimators baseline the *raw* scores within
the group, then subtract the KL penalty per token as reward-to-go (OpenRLHF's convention), so a
group of equal scores gets advantages no larger than its KL penalty. ``--algo.kl.penalty_in_baseline``
restores the other order (summed KL subtracted from each score before the baseline and the std).
Group estimators ignore ``gamma`` (it is 1 for them, as in OpenRLHF).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .numerics import masked_mean, masked_whiten


@dataclass
class AdvantageInputs:
    """What an estimator sees. ``scores`` is the combined sequence reward ``[B]``;
    ``kl_penalty`` (``[B, T]``, already scaled by the KL coefficient) is set when KL
    is applied in the reward; ``values`` (``[B, T]``) when a critic runs."""

    scores: torch.Tensor
    action_mask: torch.Tensor
    group_size: int = 1
    gamma: float = 1.0
    lam: float = 0.95
    values: torch.Tensor | None = None
    kl_penalty: torch.Tensor | None = None
    #: group estimators: subtract the summed KL from the scores before the group baseline
    kl_in_baseline: bool = False
    #: gae / reinforce / reinforce_baseline: divide by the batch std after subtracting the batch mean
    std_norm: bool = True
    #: group_norm / group_mean_batch_std: added to the std they divide by (``None``: the estimator's own)
    std_eps: float | None = None
    #: sequence advantages (those given to :meth:`sequence_to_tokens`) whitened over the batch's sequences
    #: afterwards: ``(A - mean) / (std + eps)``, unbiased std, eps ``std_eps`` or 1e-4 (TRL RLOO's
    #: normalize_advantages)
    normalize: bool = False
    #: ``[B]`` bool, False on a sample no reward source scored (every one abstained); None: every sample was.
    #: rloo leaves such samples out of their siblings' baselines and gives them advantage 0 (TRL's RLOO)
    scored: torch.Tensor | None = None

    def whiten(self, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Advantages over the batch: zero mean and unit variance, or zero mean alone without ``std_norm``."""
        if self.std_norm:
            return masked_whiten(advantages, mask)
        return (advantages - masked_mean(advantages, mask)) * mask

    def token_rewards(self) -> torch.Tensor:
        """The sequence score on each completion's last token, minus the KL penalty."""
        mask = self.action_mask.to(self.scores.dtype)
        rewards = torch.zeros_like(mask)
        rewards.scatter_(1, last_action(mask)[:, None], self.scores[:, None].to(rewards.dtype))
        if self.kl_penalty is not None:
            rewards = rewards - self.kl_penalty * mask
        return rewards * mask

    def sequence_scores(self) -> torch.Tensor:
        """What group baselines are computed from: the scores (minus the summed KL penalty
        only with ``kl_in_baseline``)."""
        if self.kl_penalty is None or not self.kl_in_baseline:
            return self.scores
        return self.scores - (self.kl_penalty * self.action_mask).sum(-1)

    def sequence_to_tokens(self, advantages: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """A sequence advantage ``[B]`` on every token (whitened over the batch first with ``normalize``), minus
        the KL penalty still to come (reward-to-go, gamma 1) when KL is in the reward and not already in the
        baseline. ``valid`` (``[B]`` bool): the sequences whose advantage counts; the others get 0 and stay out
        of the whitening."""
        if valid is not None:
            advantages = torch.where(valid, advantages, torch.zeros_like(advantages))
        if self.normalize:
            keep = torch.ones_like(advantages, dtype=torch.bool) if valid is None else valid
            if int(keep.sum()) > 1:
                eps = 1e-4 if self.std_eps is None else self.std_eps
                kept = advantages[keep]
                advantages = torch.where(keep, (advantages - kept.mean()) / (kept.std() + eps), advantages)
        mask = self.action_mask.to(advantages.dtype)
        out = advantages[:, None] * mask
        if self.kl_penalty is not None and not self.kl_in_baseline:
            out = out - (self.kl_penalty * mask).flip(-1).cumsum(-1).flip(-1) * mask
        return out

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % self.group_size:
            raise ValueError(f"batch of {x.shape[0]} is not a multiple of the group size {self.group_size}")
        return x.view(-1, self.group_size)


def last_action(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last action token (0 for a row without one)."""
    pos = torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape)
    return torch.where(mask > 0, pos, torch.zeros_like(pos)).amax(-1)


def actions_first(mask: torch.Tensor) -> torch.Tensor:
    """A per-row permutation putting action tokens first, in order. Multi-turn completions hold
    environment tokens (mask 0) between the model's turns; token-level estimators run on the
    gathered action tokens, so "the next step" is the model's next token, then scatter back.
    For contiguous masks it is the identity."""
    return torch.argsort((mask <= 0).to(torch.int8), dim=-1, stable=True)


def on_actions(fn: Callable[..., tuple[torch.Tensor, ...]], mask: torch.Tensor,
               *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``fn(mask, *tensors)`` on each row's action tokens gathered to the front, results scattered back."""
    order = actions_first(mask)
    outs = fn(mask.gather(1, order), *(t.gather(1, order) for t in tensors))
    return tuple(torch.zeros_like(o).scatter(1, order, o) for o in outs)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over action tokens, zero past each completion's end."""
    return on_actions(lambda m, r: (_returns(r, m, gamma),), mask, rewards)[0]


def _returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    return returns


def gae(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (PPO with a critic); advantages whitened over the batch."""
    if x.values is None:
        raise ValueError("gae needs critic values")
    mask = x.action_mask.to(x.values.dtype)
    advantages, returns = on_actions(lambda m, r, v: _gae(r, v, m, x.gamma, x.lam), mask, x.token_rewards(),
                                     x.values * mask)
    return x.whiten(advantages, mask), returns


def _gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
         lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    T = rewards.shape[1]
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        advantages[:, t] = last
    return advantages, (advantages + values) * mask


def reinforce(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: token-level discounted returns (KL in the reward), globally whitened."""
    mask = x.action_mask.to(x.scores.dtype)
    returns = discounted_returns(x.token_rewards(), mask, x.gamma)
    return x.whiten(returns, mask), returns


def reinforce_baseline(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: subtract the group-mean score, then as REINFORCE++."""
    scores = x.grouped(x.scores)
    centred = (scores - scores.mean(-1, keepdim=True)).reshape(-1)
    inputs = AdvantageInputs(centred, x.action_mask, x.group_size, x.gamma, x.lam, None, x.kl_penalty,
                             std_norm=x.std_norm, std_eps=x.std_eps)
    return reinforce(inputs)


def _group_done(x: AdvantageInputs, per_sequence: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = x.sequence_to_tokens(per_sequence.reshape(-1))
    return adv, adv


def group_norm(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (score - group mean) / (group std + eps), the same for every token (eps 1e-6 unless
    ``std_eps`` says)."""
    scores = x.grouped(x.sequence_scores())
    eps = 1e-6 if x.std_eps is None else x.std_eps
    return _group_done(x, (scores - scores.mean(-1, keepdim=True)) / (scores.std(-1, keepdim=True) + eps))


def dr_grpo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO: score minus group mean, no std division (pair with seq-mean-token-sum-norm)."""
    scores = x.grouped(x.sequence_scores())
    return _group_done(x, scores - scores.mean(-1, keepdim=True))


def group_mean_batch_std(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Score minus its group's mean, over the std of the batch's scores (unbiased, + 1e-4 unless
    ``std_eps`` says): TRL's ``scale_rewards="batch"`` (Lite PPO's group-level mean, batch-level std)."""
    flat = x.sequence_scores()
    scores = x.grouped(flat)
    std = flat.std() if flat.numel() > 1 else torch.zeros((), dtype=flat.dtype)
    eps = 1e-4 if x.std_eps is None else x.std_eps
    return _group_done(x, (scores - scores.mean(-1, keepdim=True)) / (std + eps))


def batch_mean(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashREINFORCE: the score minus the mean score of the whole batch (no groups, no std), the same on every
    token -- one sample per prompt is enough."""
    scores = x.sequence_scores()
    return _group_done(x, scores - scores.mean())


def rloo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score minus the mean of the *other* samples of the same prompt. A sample no reward source
    scored (``x.scored``) is in no baseline and gets advantage 0, as is the only scored sample of its group
    (TRL's RLOO)."""
    scores = x.grouped(x.sequence_scores())
    scored = torch.ones_like(scores, dtype=torch.bool) if x.scored is None else x.grouped(x.scored.to(scores.device))
    kept = torch.where(scored, scores, torch.zeros_like(scores))
    others = scored.sum(-1, keepdim=True) - 1
    baseline = (kept.sum(-1, keepdim=True) - kept) / others.clamp(min=1)
    valid = (scored & (others > 0)).reshape(-1)
    adv = x.sequence_to_tokens((scores - baseline).reshape(-1), valid)
    return adv, adv
