"""The training objective: policy loss + KL term - entropy bonus, aggregated.

Built once before the first step from resolved components (plain functions), so
the learner calls it without touching the plugin manager. It is a picklable
dataclass: Ray learner workers receive it as is.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .kl import ratio_weights, unbiased_term
from .mismatch import weights_for
from .numerics import aggregate, high_entropy_mask, masked_mean, micro_batch_weight
from .policy_losses import PolicyLossInputs, off_policy_mask


@dataclass
class Objective:
    policy_loss: Callable[..., tuple[torch.Tensor, dict]]
    options: Any  # PolicyLossConfig
    kl_estimator: Callable[..., torch.Tensor] | None = None
    #: KL coefficient of the loss term (0 when KL is applied in the reward)
    kl_coef: float = 0.0
    #: the constant length of ``seq-mean-token-sum-norm`` (the generation budget)
    norm_length: float | None = None
    #: weight the KL loss term by the policy ratio: none | token | sequence (``--algo.kl.ratio``)
    kl_ratio: str = "none"
    #: the KL term's value with the reverse-KL gradient (``--algo.kl.unbiased_gradient``)
    kl_unbiased: bool = False
    #: this step's entropy-bonus coefficient (an adaptive one changes per step); empty: the options'
    entropy_coef: float | None = None

    @property
    def bonus(self) -> float:
        """The entropy bonus's coefficient."""
        return self.options.entropy_coef if self.entropy_coef is None else self.entropy_coef

    @property
    def aggregation(self) -> str:
        return self.options.aggregation

    @property
    def top_entropy(self) -> float:
        """The fraction of highest-entropy tokens the policy loss trains (1: all)."""
        return float(getattr(self.options, "top_entropy_quantile", 1.0))

    @property
    def needs_entropy(self) -> bool:
        adaptive = getattr(self.options, "entropy_target", None) is not None  # measured even while it is 0
        logged = bool(getattr(self.options, "log_entropy", False))
        return self.bonus != 0.0 or self.top_entropy < 1.0 or adaptive or logged

    def weight(self, micro_mask: torch.Tensor, mini_mask: torch.Tensor) -> float:
        return micro_batch_weight(micro_mask, mini_mask, self.aggregation)

    def __call__(
        self, outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``outputs`` holds the learner's forward (``logprobs``, maybe ``entropy``)."""
        logprobs = outputs["logprobs"]
        entropy = outputs.get("entropy")
        mask = batch["action_mask"].to(logprobs.dtype)
        old, rollout, gap = batch.get("old_logprobs"), batch.get("rollout_logprobs"), None
        if rollout is not None and self.options.mismatch == "engine_ratio":  # pi_theta / mu: the engine's policy
            learner = logprobs if old is None else old  # the train/inference gap, as measured without the option
            gap, old = masked_mean((learner - rollout).detach().abs(), mask), rollout
        inputs = PolicyLossInputs(
            logprobs=logprobs,
            old_logprobs=logprobs.detach() if old is None else old,
            advantages=batch["advantages"],
            action_mask=mask,
            rollout_logprobs=rollout,
        )
        per_token, metrics = self.policy_loss(inputs, self.options)
        if not torch.is_tensor(per_token) or per_token.shape != mask.shape:
            from ..errors import PluginError

            got = tuple(per_token.shape) if torch.is_tensor(per_token) else type(per_token).__name__
            raise PluginError(f"policy loss '{getattr(self.options, 'name', '?')}' returned {got}; it must return the "
                              f"per-token loss {tuple(mask.shape)} ([B, T]) and a dict of metrics")
        per_token = self._select_and_weight(per_token, inputs, entropy, metrics)
        if gap is not None:
            metrics["mismatch/abs_log_ratio"] = gap
        policy = aggregate(per_token, mask, self.aggregation, self.norm_length)
        loss = policy
        metrics = {k: v.detach() if torch.is_tensor(v) else v for k, v in metrics.items()}
        metrics["loss/policy"] = policy.detach()
        ref = batch.get("ref_logprobs")
        if ref is not None and self.kl_estimator is not None:
            kl = self.kl_estimator(logprobs, ref)
            if self.kl_coef:
                kl_loss = aggregate(self._kl_term(kl, logprobs, ref, inputs), mask, self.aggregation, self.norm_length)
                loss = loss + self.kl_coef * kl_loss
            metrics["kl"] = masked_mean(kl.detach(), mask)
        if entropy is not None:
            if self.bonus:  # the bonus is aggregated as the loss is
                loss = loss - self.bonus * aggregate(entropy, mask, self.aggregation, self.norm_length)
            metrics["entropy"] = masked_mean(entropy.detach(), mask)  # nats per token, whatever the aggregation
        metrics["loss/total"] = loss.detach()
        return loss, metrics

    def _kl_term(self, kl: torch.Tensor, logprobs: torch.Tensor, ref: torch.Tensor,
                 inputs: PolicyLossInputs) -> torch.Tensor:
        """The per-token KL loss term: the estimate, weighted by the policy ratio or with the unbiased gradient."""
        if self.kl_unbiased:
            return unbiased_term(kl, logprobs, ref, inputs.old_logprobs)
        if self.kl_ratio == "none":
            return kl
        return kl * ratio_weights(logprobs, inputs.old_logprobs, inputs.action_mask, self.kl_ratio)

    def _select_and_weight(self, per_token: torch.Tensor, inputs: PolicyLossInputs, entropy: torch.Tensor | None,
                           metrics: dict[str, torch.Tensor]) -> torch.Tensor:
        """The per-token policy loss restricted to the tokens it trains (highest-entropy tokens,
        off-policy sequence masking) and weighted for the engine/learner mismatch; logs each."""
        mask = inputs.action_mask
        if self.top_entropy < 1.0 and entropy is not None:  # the forking tokens only (TRL's entropy mask)
            kept = high_entropy_mask(entropy.detach(), mask, self.top_entropy)
            per_token = per_token * kept
            metrics["loss/entropy_kept_frac"] = masked_mean(kept, mask)
        threshold = getattr(self.options, "off_policy_mask", None)
        if threshold is not None:  # DeepSeek-V3.2's off-policy sequence masking
            kept = off_policy_mask(inputs, threshold)
            per_token = per_token * kept
            metrics["loss/off_policy_masked_frac"] = masked_mean(1 - kept, mask)
        own = getattr(self.policy_loss, "corrects_mismatch", False)  # VESPO: inside its sequence weight
        if self.options.mismatch == "engine_ratio":  # in the policy's ratio already
            return per_token
        if self.options.mismatch != "none" and inputs.rollout_logprobs is not None and not own:
            weights, extra = weights_for(self.options, inputs.old_logprobs, inputs.rollout_logprobs, mask)
            per_token = per_token * weights
            metrics.update(extra)
        elif inputs.rollout_logprobs is not None:  # the train/inference gap, measured even when not corrected
            gap = (inputs.old_logprobs - inputs.rollout_logprobs).detach().abs()
            metrics["mismatch/abs_log_ratio"] = masked_mean(gap, mask)
        return per_token
