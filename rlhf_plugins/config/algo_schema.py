"""The algorithm's sections of the run configuration (``algo.advantage``, ``algo.policy_loss``,
``algo.kl``, ``critic``); :mod:`rlhf_plugins.config.schema` assembles them into :class:`Config`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..settings import setting


@dataclass
class AdvantageConfig:
    #: group_norm (GRPO) | dr_grpo | rloo | group_mean_batch_std | batch_mean (FlashREINFORCE) | reinforce |
    #: reinforce_baseline | gae (PPO, with a critic)
    estimator: str = "group_norm"
    #: discount per token (gae, reinforce)
    gamma: float = setting(1.0, ge=0, le=1)
    #: GAE lambda: 1 is Monte-Carlo returns, 0 one-step TD
    lam: float = setting(0.95, ge=0, le=1)
    #: gae, reinforce and reinforce_baseline whiten advantages over the batch; false: subtract the batch
    #: mean alone (OpenRLHF's --no_advantage_std_norm); the group estimators normalise within groups
    std_norm: bool = True
    #: what group_norm and group_mean_batch_std add to the std they divide by; empty: 1e-6 and 1e-4
    #: (OpenRLHF's group_norm adds 1e-9, TRL 1e-4: the converters set it)
    std_eps: float | None = setting(None, ge=0)
    #: the group estimators' sequence advantages whitened over the batch afterwards, (A - mean) / (std + eps)
    #: with std_eps or 1e-4 (TRL RLOOTrainer's normalize_advantages); gae and reinforce(_baseline): std_norm
    normalize_advantages: bool = False


@dataclass
class PolicyLossConfig:
    #: ppo (token-level ratio) | gspo (sequence-level ratio) | sequence_ppo (the completion as one action:
    #: the product of token ratios, TRL's RLOO) | cispo (capped ratio as a weight) | sapo (soft gate) |
    #: vespo (sequence-weight shaped REINFORCE) or a plugin's
    name: str = "ppo"
    #: ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_low: float = setting(0.2, ge=0, lt=1)
    #: upper clip range; above clip_low it is DAPO's clip-higher
    clip_high: float = setting(0.2, ge=0)
    #: dual-clip bound c > 1 for negative advantages; empty disables it
    dual_clip: float | None = setting(None, gt=1)
    #: cispo and sapo: an importance ratio per token, or one per sequence, the geometric mean of its token
    #: ratios (TRL's importance_sampling_level sequence); ppo's sequence form is the gspo loss
    ratio_level: Literal["token", "sequence"] = "token"
    #: sapo's gate temperature for tokens of positive advantage (TRL's sapo_temperature_pos)
    sapo_temperature_pos: float = setting(1.0, gt=0)
    #: sapo's gate temperature for the other tokens (TRL's sapo_temperature_neg)
    sapo_temperature_neg: float = setting(1.05, gt=0)
    #: vespo's exponent k of phi(w) = exp(lambda + k log w - lambda w) for advantages >= 0 (TRL's vespo_k_pos)
    vespo_k_pos: float = setting(2.0, ge=0)
    #: vespo's decay lambda for advantages >= 0 (TRL's vespo_lambda_pos)
    vespo_lambda_pos: float = setting(3.0, ge=0)
    #: vespo's k for negative advantages (TRL's vespo_k_neg)
    vespo_k_neg: float = setting(3.0, ge=0)
    #: vespo's lambda for negative advantages (TRL's vespo_lambda_neg)
    vespo_lambda_neg: float = setting(2.0, ge=0)
    #: token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm;
    #: empty: the loss's own default (token-mean; seq-mean-token-mean for gspo)
    aggregation: str | None = None
    #: the constant divisor of seq-mean-token-sum-norm (Dr. GRPO); empty: generation.max_new_tokens
    norm_length: int | None = setting(None, ge=1)
    #: entropy bonus coefficient (0: none); with entropy_target, its starting value
    entropy_coef: float = setting(0.0)
    #: adapt the entropy bonus (Skywork-OR1; TRL's use_adaptive_entropy): it applies only while the
    #: measured entropy (nats per token) is at or below this, and its coefficient moves by
    #: entropy_coef_delta after each step towards keeping it there; empty: a fixed coefficient
    entropy_target: float | None = setting(None, gt=0)
    #: the adaptive coefficient's move per step
    entropy_coef_delta: float = setting(0.005, gt=0)
    #: the adaptive coefficient's lower bound
    entropy_coef_min: float = setting(0.0, ge=0)
    #: the adaptive coefficient's upper bound
    entropy_coef_max: float = setting(1.0, ge=0)
    #: measure the policy's entropy (nats per token, the metric ``entropy``) at every update even when no
    #: term uses it (TRL's GRPOTrainer always does; its configs set this): one more pass over each chunk
    #: of vocabulary logits in the learner's head, no backward
    log_entropy: bool = False
    #: the policy loss trains only the tokens whose entropy is in this top fraction of their micro
    #: batch's (1: every token; TRL's top_entropy_quantile, "Beyond the 80/20 rule": 0.2)
    top_entropy_quantile: float = setting(1.0, gt=0, le=1)
    #: completions cut off by the budget (no stop) leave the loss -- policy, KL, entropy and value
    #: terms -- after advantages are computed, so their rewards still count in their group's baseline
    #: (DAPO's overlong filtering; TRL's mask_truncated_completions)
    mask_truncated: bool = False
    #: drop from the policy loss the negative-advantage tokens of sequences whose mean
    #: log(mu / pi) -- mu the sampling policy -- exceeds this (DeepSeek-V3.2's off-policy sequence
    #: masking; TRL's off_policy_mask_threshold); empty: none
    off_policy_mask: float | None = setting(None, ge=0)
    #: correct the generation engine / learner mismatch with the engine's log-probs:
    #: none | tis (truncated token weights) | icepop (mask tokens outside the band) | seq_icepop (mask
    #: sequences whose geometric-mean ratio leaves the band) | seq_mask_tis (the same, kept weights capped) |
    #: seq_tis (truncated sequence weight) | seq_mask (sequence weight, zero outside the band) | engine_ratio (the
    #: policy loss's ratio taken against the engine's log-probs, pi_theta / mu, instead of the learner's old ones)
    mismatch: Literal["none", "tis", "icepop", "seq_icepop", "seq_mask_tis", "seq_tis", "seq_mask",
                      "engine_ratio"] = "none"
    #: TIS truncation and upper band of icepop / seq_mask_tis / seq_mask
    mismatch_high: float = setting(2.0, ge=1)
    #: lower band of icepop / seq_mask_tis / seq_mask (0: none)
    mismatch_low: float = setting(0.5, ge=0, le=1)
    #: TIS (and seq_tis) also clamp weights from below at this value (0: truncate from above only)
    tis_floor: float = setting(0.0, ge=0, le=1)
    #: what icepop / seq_icepop gate on: ratio (the band) | binary_kl | tv (the sampled token's divergence
    #: between engine and learner, per token or its sequence mean, up to mismatch_max_divergence)
    mismatch_gate: Literal["ratio", "binary_kl", "tv"] = "ratio"
    #: the largest divergence a binary_kl / tv gate keeps (FlashREINFORCE's delta: 5e-3)
    mismatch_max_divergence: float = setting(0.005, gt=0)


@dataclass
class KLConfig:
    #: k1 (log-ratio) | k2 (squared log-ratio / 2) | k3 (Schulman's unbiased, non-negative)
    estimator: str = "k3"
    #: 0 disables the reference model entirely
    coef: float = setting(0.001, ge=0)
    #: apply KL as a token-level penalty in the reward instead of a loss term
    in_reward: bool = False
    #: with in_reward and a group estimator: subtract the summed KL from each score *before* the
    #: group baseline (amplifies KL noise in groups of equal scores); default: baseline the raw
    #: scores, then subtract the KL per token as reward-to-go
    penalty_in_baseline: bool = False
    #: fixed coefficient, or adaptive (Ziegler et al.): steer the measured KL towards ``target``
    controller: Literal["fixed", "adaptive"] = "fixed"
    #: the KL the adaptive controller steers towards
    target: float = setting(0.1, gt=0)
    #: samples over which the adaptive controller moves the coefficient
    horizon: int = setting(10000, ge=1)
    #: weight the KL loss term by the policy ratio pi/pi_old (differentiable): none | token | sequence
    #: (DeepSeek-V3.2's unbiased KL gradient; TRL's use_bias_correction_kl, its default)
    ratio: Literal["none", "token", "sequence"] = "none"
    #: keep the estimator's value, take the reverse-KL gradient: pi/pi_old (capped at 10, held constant) x
    #: log(pi/pi_ref) x grad log pi, the same for k1, k2 and k3 (OpenRLHF's --algo.kl.unbiased_gradient)
    unbiased_gradient: bool = False
    #: every N steps move the reference model towards the policy (TR-DPO; TRL's sync_ref_model); 0: it
    #: stays the initial policy
    ref_sync_steps: int = setting(0, ge=0)
    #: the move: reference = alpha x policy + (1 - alpha) x reference (TRL's ref_model_mixup_alpha)
    ref_mixup_alpha: float = setting(0.6, gt=0, le=1)


#: the critic's optimizer settings of its own (:meth:`~rlhf_plugins.config.schema.Config.learner_of`)
CRITIC_OWN = ("optimizer", "betas", "eps", "weight_decay", "max_grad_norm", "lr_scheduler", "warmup_ratio",
              "min_lr_ratio", "muon_lr", "muon_momentum", "muon_nesterov", "muon_ns_steps")


@dataclass
class CriticConfig:
    #: empty: a critic runs exactly when the advantage estimator needs one
    enabled: bool | None = None
    #: a local folder with a critic (or any causal LM); empty: initialised from the policy
    path: str | None = None
    #: learning rate of the critic
    lr: float = setting(5e-3, gt=0)
    #: value-loss clipping around the rollout-time values; empty disables it
    value_clip: float | None = setting(0.2, gt=0)
    #: the first N steps train only the critic, the actor waits (OpenRLHF's --freezing_actor_steps)
    freezing_steps: int = setting(0, ge=0)
    # the critic's own optimizer settings (OpenRLHF 0.11's --critic.optim, --critic.adam.betas, ...)
    #: the critic's optimizer; empty: learner.optimizer
    optimizer: Literal["adamw", "adam", "sgd", "muon", "adafactor"] | None = None
    #: the critic's Muon learning rate (OpenRLHF 0.11's --critic.muon.lr); empty: learner.muon_lr
    muon_lr: float | None = setting(None, gt=0)
    #: the critic's Muon momentum (OpenRLHF 0.11's --critic.muon.momentum); empty: learner.muon_momentum
    muon_momentum: float | None = setting(None, ge=0, lt=1)
    #: the critic's Muon Nesterov momentum; empty: learner.muon_nesterov
    muon_nesterov: bool | None = None
    #: the critic's Newton-Schulz iterations per Muon step; empty: learner.muon_ns_steps
    muon_ns_steps: int | None = setting(None, ge=1)
    #: the critic's Adam(W) beta1 and beta2; empty: learner.betas
    betas: list[float] | None = None
    #: the critic's Adam(W) epsilon; empty: learner.eps
    eps: float | None = setting(None, gt=0)
    #: the critic's weight decay; empty: learner.weight_decay
    weight_decay: float | None = setting(None, ge=0)
    #: clip the critic's gradient norm to this (0: no clipping); empty: learner.max_grad_norm
    max_grad_norm: float | None = setting(None, ge=0)
    #: the critic's learning-rate schedule; empty: learner.lr_scheduler
    lr_scheduler: Literal["constant", "linear", "cosine"] | None = None
    #: the critic's warm-up as a share of its optimizer updates; empty: learner.warmup_steps / warmup_ratio
    warmup_ratio: float | None = setting(None, ge=0, le=1)
    #: where the critic's linear or cosine decay ends, as a share of critic.lr; empty: learner.min_lr_ratio
    min_lr_ratio: float | None = setting(None, ge=0, le=1)


@dataclass
class AlgoConfig:
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
