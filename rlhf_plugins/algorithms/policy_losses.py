"""Policy-gradient surrogates. Each returns a per-token loss ``[B, T]`` and metrics;
the objective aggregates it, so every loss supports every aggregation mode."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .mismatch import weights_for
from .numerics import masked_extreme, masked_mean

#: the policy's log ratio is clamped to +-this before ``exp`` (as OpenRLHF): one wild token cannot
#: blow the loss up; ``loss/ratio_clamp_frac`` says how often it fired
LOG_RATIO_CLAMP = 20.0


@dataclass
class PolicyLossInputs:
    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    action_mask: torch.Tensor
    #: log-probs the generation engine reported while sampling (mismatch correction)
    rollout_logprobs: torch.Tensor | None = None


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, o: Any,
             per_sequence: bool = False) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate per token, and the shares the clip held -- of tokens, or with ``per_sequence``
    (a ratio per sequence) of sequences, each weighing 1 whatever its length."""
    surr1 = ratio * adv
    surr2 = ratio.clamp(1 - o.clip_low, 1 + o.clip_high) * adv
    loss = -torch.min(surr1, surr2)
    clipped = (surr2 < surr1).float()
    metrics = {}
    if per_sequence:
        mask = mask / mask.sum(-1, keepdim=True).clamp(min=1)
    if o.dual_clip is not None:
        bound = -o.dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(adv < 0, torch.min(loss, bound), loss)
        metrics["loss/dual_clip_frac"] = masked_mean(dual.float(), mask)
    metrics["loss/clip_frac"] = masked_mean(clipped, mask)  # = low + high: the clip decided these tokens
    # TRL's clip_ratio/low_mean and /high_mean: below the band with a negative advantage, above it with a positive
    low, high = ((ratio < 1 - o.clip_low) & (adv < 0)).float(), ((ratio > 1 + o.clip_high) & (adv > 0)).float()
    metrics["loss/clip_low_frac"], metrics["loss/clip_high_frac"] = masked_mean(low, mask), masked_mean(high, mask)
    # and its clip_ratio/low_min and /high_max: the extremes of those shares over the sequences
    metrics["loss/clip_low_seq_min"] = masked_extreme(masked_mean(low, mask, dim=-1), mask.sum(-1) > 0, False)
    metrics["loss/clip_high_seq_max"] = masked_extreme(masked_mean(high, mask, dim=-1), mask.sum(-1) > 0, True)
    return loss, metrics


def ppo(x: PolicyLossInputs, o: Any) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate, asymmetric clip ``[1 - clip_low, 1 + clip_high]``,
    optional dual clip bounding the loss of negative advantages by ``-c * A``."""
    log_ratio, clamped = _clamp(x.logprobs - x.old_logprobs)
    ratio = torch.exp(log_ratio)
    loss, metrics = _clipped(ratio, x.advantages, x.action_mask, o)
    metrics["loss/ratio_mean"] = masked_mean(ratio.detach(), x.action_mask)
    metrics["loss/ratio_clamp_frac"] = masked_mean(clamped, x.action_mask)
    return loss, metrics


def _clamp(log_ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    clamped = (log_ratio.detach().abs() > LOG_RATIO_CLAMP).float()
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), clamped


def gspo(x: PolicyLossInputs, o: Any) -> tuple[torch.Tensor, dict]:
    """GSPO: one importance ratio per sequence (the geometric mean of token ratios),
    clipped as in PPO; gradients flow through every token (GSPO-token form). The clip acts on sequences,
    so its shares count sequences (as TRL's with importance_sampling_level sequence)."""
    mask = x.action_mask
    seq_log_ratio, clamped = _clamp(masked_mean(x.logprobs - x.old_logprobs, mask, dim=-1))
    log_ratio = seq_log_ratio.detach()[:, None] + x.logprobs - x.logprobs.detach()
    ratio = torch.exp(log_ratio)
    loss, metrics = _clipped(ratio, x.advantages, mask, o, per_sequence=True)
    metrics["loss/ratio_mean"] = seq_log_ratio.detach().exp().mean()
    metrics["loss/ratio_clamp_frac"] = clamped.mean()
    return loss, metrics


def sequence_ppo(x: PolicyLossInputs, o: Any) -> tuple[torch.Tensor, dict]:
    """PPO with each completion as one action (TRL's RLOOTrainer): the sequence's ratio is the product of its
    token ratios, ``exp(sum log pi - log pi_old)``, clipped once per sequence, its gradient reaching every
    token through the sum. Each token carries its sequence's clipped surrogate, so seq-mean-token-mean (its
    default) is the mean over sequences; the clip metrics count sequences, not tokens."""
    mask = x.action_mask
    seq_log_ratio, clamped = _clamp(((x.logprobs - x.old_logprobs) * mask).sum(-1))
    ratio = torch.exp(seq_log_ratio)[:, None].expand_as(x.logprobs)
    per_sequence = mask / mask.sum(-1, keepdim=True).clamp(min=1)  # each sequence's tokens weigh 1 in all
    loss, metrics = _clipped(ratio, x.advantages, per_sequence, o)
    metrics["loss/ratio_mean"] = masked_mean(ratio.detach(), per_sequence)
    metrics["loss/ratio_clamp_frac"] = masked_mean(clamped[:, None].expand_as(mask), per_sequence)
    return loss, metrics


def _log_ratio(x: PolicyLossInputs, o: Any, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The clamped log-ratio per token, or with ``ratio_level sequence`` each sequence's mean log-ratio on
    every one of its tokens (the gradient, where ``logprobs`` carries one, reaches every token through the
    mean); and where the clamp acted."""
    log_ratio = logprobs - x.old_logprobs
    if getattr(o, "ratio_level", "token") == "sequence":
        log_ratio = masked_mean(log_ratio, x.action_mask, dim=-1)[:, None].expand_as(log_ratio)
    return _clamp(log_ratio)


def cispo(x: PolicyLossInputs, o: Any) -> tuple[torch.Tensor, dict]:
    """CISPO (MiniMax-M1): ``-sg(min(r, 1 + clip_high)) * A * log pi``. The ratio is capped as a
    constant weight instead of clipping the token out of the gradient, so every token keeps its
    REINFORCE gradient (a token above the cap with the cap's weight); ``clip_low`` is not used.
    ``ratio_level sequence``: ``r`` is the sequence's (TRL's importance_sampling_level sequence)."""
    log_ratio, clamped = _log_ratio(x, o, x.logprobs.detach())
    ratio = torch.exp(log_ratio)
    cap = 1 + o.clip_high
    loss = -ratio.clamp(max=cap) * x.advantages * x.logprobs
    metrics = {"loss/clip_frac": masked_mean((ratio > cap).float(), x.action_mask),
               # capped with a positive advantage: TRL's cispo_clip_ratio
               "loss/clip_high_frac": masked_mean(((ratio > cap) & (x.advantages > 0)).float(), x.action_mask),
               "loss/ratio_mean": masked_mean(ratio, x.action_mask),
               "loss/ratio_clamp_frac": masked_mean(clamped, x.action_mask)}
    return loss, metrics


def sapo(x: PolicyLossInputs, o: Any) -> tuple[torch.Tensor, dict]:
    """SAPO (soft adaptive policy optimization): a smooth gate instead of the hard clip,
    ``-sigmoid(tau (r - 1)) * 4 / tau * A`` with ``tau = sapo_temperature_pos`` where ``A > 0`` and
    ``sapo_temperature_neg`` elsewhere. At ``r = 1`` it is the plain policy gradient; the gradient
    fades as the ratio leaves 1, faster for the larger temperature. ``ratio_level sequence``: one gate per
    sequence on its ratio, whose gradient reaches every token through the mean log-ratio (as TRL's)."""
    log_ratio, clamped = _log_ratio(x, o, x.logprobs)
    ratio = torch.exp(log_ratio)
    tau = torch.where(x.advantages > 0, o.sapo_temperature_pos, o.sapo_temperature_neg).to(ratio.dtype)
    loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * x.advantages
    metrics = {"loss/ratio_mean": masked_mean(ratio.detach(), x.action_mask),
               "loss/ratio_clamp_frac": masked_mean(clamped, x.action_mask)}
    return loss, metrics


def vespo(x: PolicyLossInputs, o: Any) -> tuple[torch.Tensor, dict]:
    """VESPO: ``-sg(phi(w)) * A * log pi`` with ``w`` the sequence's importance weight (the product of
    its token ratios against the rollout-time policy -- and, with a token mismatch correction, of the
    engine/learner weights, which then enter here instead of multiplying the loss) and the gamma-shaped
    ``phi(w) = exp(lambda + k log w - lambda w)`` (1 at ``w = 1``): ``k = vespo_k_pos`` and
    ``lambda = vespo_lambda_pos`` where ``A >= 0``, ``vespo_k_neg`` / ``vespo_lambda_neg`` elsewhere."""
    mask = x.action_mask
    floor = math.log(1e-8)
    log_w = ((x.logprobs.detach() - x.old_logprobs).clamp(-20, 20) * mask).sum(-1, keepdim=True)
    if o.mismatch != "none" and x.rollout_logprobs is not None:
        weights, _ = weights_for(o, x.old_logprobs, x.rollout_logprobs, mask)
        log_w = log_w + (weights.clamp(min=1e-30).log().clamp(floor, 20) * mask).sum(-1, keepdim=True)
    log_w = log_w.clamp(floor, 20)
    positive = x.advantages >= 0
    k = torch.where(positive, o.vespo_k_pos, o.vespo_k_neg).to(log_w.dtype)
    lam = torch.where(positive, o.vespo_lambda_pos, o.vespo_lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    loss = -phi * x.advantages * x.logprobs
    metrics = {"loss/vespo_phi_mean": masked_mean(phi, mask),
               "loss/ratio_mean": masked_mean(log_w.exp().expand_as(mask), mask)}
    return loss, metrics


#: VESPO takes the engine/learner mismatch weights into its sequence weight: the objective does not
#: multiply its per-token loss by them again
vespo.corrects_mismatch = True  # type: ignore[attr-defined]


def off_policy_mask(x: PolicyLossInputs, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence masking: 0 for the tokens of negative advantage in
    sequences whose mean ``log mu - log pi`` (mu: the policy that sampled them -- the engine's
    log-probs when given, else the rollout-time learner's) exceeds ``threshold``, 1 elsewhere.
    No gradient: it only selects tokens."""
    sampled = x.old_logprobs if x.rollout_logprobs is None else x.rollout_logprobs
    drift = masked_mean(torch.nan_to_num(sampled - x.logprobs.detach()), x.action_mask, dim=-1)
    return ((x.advantages >= 0) | (drift <= threshold)[:, None]).to(x.logprobs.dtype)
