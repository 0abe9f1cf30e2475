"""TRL's algorithm fields as ours: clipping, the loss type and its aggregation, the KL term, reward
scaling, the sampling correction and the moving reference (:mod:`.trl_config` calls these)."""
from __future__ import annotations

from typing import Any

from ..config.loading import set_dotted as _set
from ..errors import ConfigError
from .trl_cadence import whole_rollouts
from .trl_fields import LOSS_NAMES, LOSS_TYPES, SAMPLING_CORRECTION


def algorithm(f: dict[str, Any], raw: dict[str, Any], notes: list[str]) -> None:
    """Clipping, KL estimator, loss aggregation, sequence-level ratios, reward scaling, sampling correction."""
    high = float(f["epsilon_high"] if f["epsilon_high"] is not None else f["epsilon"])
    _set(raw, "algo.policy_loss.clip_high", high)
    _set(raw, "algo.kl.estimator", "k3")
    loss = f["loss_type"]
    if loss not in LOSS_TYPES:
        raise ConfigError(f"TRL loss_type '{loss}' has no equivalent; choose one of: {', '.join(LOSS_TYPES)}")
    _set(raw, "algo.policy_loss.aggregation", LOSS_TYPES[loss])
    if f.get("delta") is not None:
        _two_sided(float(f["delta"]), loss, high, raw, notes)
    if loss in LOSS_NAMES:
        _loss_of_its_own(f, raw, loss, high)
    elif f["importance_sampling_level"] == "sequence":
        _set(raw, "algo.policy_loss.name", "gspo")
    if f["use_bias_correction_kl"] and float(f["beta"]):  # TRL's default: the KL term times the policy ratio
        _set(raw, "algo.kl.ratio", "sequence" if f["importance_sampling_level"] == "sequence" else "token")
    _advantages(f, raw, notes)
    if f["use_vllm"] and f["vllm_importance_sampling_correction"]:
        _sampling_correction(f, raw)


def rloo_algorithm(f: dict[str, Any], raw: dict[str, Any], notes: list[str]) -> None:
    """TRL's RLOOTrainer: the leave-one-out baseline over the group (the sequence advantages whitened over the
    batch with normalize_advantages), PPO's clip on each completion's ratio -- the product of its token ratios --
    averaged over completions, and with beta the KL in the reward: beta x the summed log-ratio to the reference
    (k1) taken from each score before the baseline; reward_clip_range clamps the weighted sum of the rewards."""
    high = float(f["epsilon_high"] if f["epsilon_high"] is not None else f["epsilon"])
    _set(raw, "algo.policy_loss.clip_high", high)
    _set(raw, "algo.policy_loss.name", "sequence_ppo")
    _set(raw, "algo.policy_loss.aggregation", "seq-mean-token-mean")
    _set(raw, "algo.advantage.estimator", "rloo")
    if f["normalize_advantages"]:
        _set(raw, "algo.advantage.normalize_advantages", True)
    if float(f["beta"]):
        for key, value in (("in_reward", True), ("estimator", "k1"), ("penalty_in_baseline", True)):
            _set(raw, f"algo.kl.{key}", value)
    if f.get("reward_clip_range") is not None:
        try:
            low, top = (float(x) for x in f["reward_clip_range"])
        except (TypeError, ValueError):
            raise ConfigError(f"TRL field 'reward_clip_range' expects two numbers (low, high); got "
                              f"{f['reward_clip_range']!r}") from None
        if not low < top or top <= 0:
            raise ConfigError(f"TRL reward_clip_range ({low:g}, {top:g}) has no equivalent here: --reward.clip "
                              "takes a low bound below a high bound above 0")
        _set(raw, "reward.clip", top)
        _set(raw, "reward.clip_low", low)


def _two_sided(delta: float, loss: str, high: float, raw: dict[str, Any], notes: list[str]) -> None:
    """TRL's ``delta`` (INTELLECT-2's two-sided clip: ``-min(min(r, delta) A, clip(r) A)``), which TRL applies
    to its clipped losses only. Above 1 + epsilon_high it is our dual clip with c = delta; from 1 up to there
    it caps a positive advantage's ratio at delta and a negative one's at 1 + epsilon_high: clip_high
    delta - 1 with the dual clip c = 1 + epsilon_high (value and gradient equal: tests/test_algorithms.py)."""
    if loss in LOSS_NAMES:
        notes.append(f"TRL field 'delta' is ignored under loss_type '{loss}', as TRL ignores it: it bounds the "
                     "clipped surrogate of the other loss types")
        return
    if delta <= 1:
        raise ConfigError(f"TRL delta {delta:g} caps the ratio of every positive advantage below 1 (TRL recommends "
                          "delta > 1 + epsilon); set delta above 1, or drop it")
    if delta > 1 + high:
        _set(raw, "algo.policy_loss.dual_clip", delta)
    else:
        _set(raw, "algo.policy_loss.clip_high", round(delta - 1, 12))  # 1.2 - 1 prints as 0.19999999999999996
        _set(raw, "algo.policy_loss.dual_clip", 1 + high)


def _sampling_correction(f: dict[str, Any], raw: dict[str, Any]) -> None:
    """vLLM's importance-sampling correction: the mode, and its band (clip_min, clip_max; the older cap
    is clip_max, as TRL reads it). An open bound is 0 below, 1e9 above (beyond any ratio the weights'
    log clamp of +-20 lets through)."""
    mode = f["vllm_importance_sampling_mode"]
    if mode not in SAMPLING_CORRECTION:
        raise ConfigError(f"TRL vllm_importance_sampling_mode '{mode}' has no equivalent; choose one of: "
                          f"{', '.join(SAMPLING_CORRECTION)}")
    _set(raw, "algo.policy_loss.mismatch", SAMPLING_CORRECTION[mode])
    high = f.get("vllm_importance_sampling_cap")
    high = f.get("vllm_importance_sampling_clip_max") if high is None else high
    low = float(f.get("vllm_importance_sampling_clip_min") or 0.0)
    _set(raw, "algo.policy_loss.mismatch_high", 1e9 if high is None else float(high))
    _set(raw, "algo.policy_loss.tis_floor" if mode.endswith("truncate") else "algo.policy_loss.mismatch_low", low)


def _advantages(f: dict[str, Any], raw: dict[str, Any], notes: list[str]) -> None:
    """scale_rewards as the estimator; multi_objective_aggregation normalize_then_sum (GDPO) as
    --reward.combine, whose sum TRL then normalises over the batch whatever scale_rewards says."""
    if f["multi_objective_aggregation"] == "normalize_then_sum":
        _set(raw, "reward.combine", "normalize_then_sum")
        _set(raw, "algo.advantage.estimator", "group_mean_batch_std")
        notes.append("multi_objective_aggregation 'normalize_then_sum' (GDPO): each reward normalised in its group, "
                     "summed by weight, then divided by the batch's std (group_mean_batch_std: the sum's group "
                     "mean, which is TRL's batch mean unless a reward abstains); scale_rewards is unused")
        return
    if f["multi_objective_aggregation"] != "sum_then_normalize":
        raise ConfigError(f"TRL multi_objective_aggregation '{f['multi_objective_aggregation']}' has no "
                          "equivalent; use sum_then_normalize or normalize_then_sum")
    scale = f["scale_rewards"]
    scale = {True: "group", False: "none"}.get(scale, scale)
    estimator = {"group": "group_norm", "none": "dr_grpo", "batch": "group_mean_batch_std"}.get(str(scale))
    if estimator is None:
        raise ConfigError(f"TRL scale_rewards '{scale}' has no equivalent; use group, batch or none")
    _set(raw, "algo.advantage.estimator", estimator)
    if estimator != "dr_grpo":
        _set(raw, "algo.advantage.std_eps", 1e-4)  # TRL divides by std + 1e-4


def _loss_of_its_own(f: dict[str, Any], raw: dict[str, Any], loss: str, high: float) -> None:
    """cispo, sapo and vespo: their ratios per token or per sequence (vespo's weight is its sequence's either
    way, as in TRL); cispo's weight cap is epsilon_high itself (ScaleRL's eps_max, 5.0 recommended), our cap
    1 + clip_high."""
    if f["importance_sampling_level"] == "sequence" and loss in ("cispo", "sapo"):
        _set(raw, "algo.policy_loss.ratio_level", "sequence")
    elif f["importance_sampling_level"] not in ("token", "sequence"):
        raise ConfigError(f"TRL loss_type '{loss}' with importance_sampling_level "
                          f"'{f['importance_sampling_level']}' has no equivalent here: set it to 'token'")
    if loss == "cispo":
        if high < 1:
            raise ConfigError(f"TRL loss_type 'cispo' caps the ratio at epsilon_high, here {high:g}, below 1: "
                              "set epsilon_high to the cap (TRL recommends 5.0)")
        _set(raw, "algo.policy_loss.clip_high", high - 1)
    _set(raw, "algo.policy_loss.name", LOSS_NAMES[loss])


def reference_sync(f: dict[str, Any], raw: dict[str, Any], notes: list[str], updates_per_rollout: int) -> None:
    """sync_ref_model: TRL mixes every ref_model_sync_steps optimizer updates; we after whole rollouts."""
    if not f["sync_ref_model"]:
        return
    if not float(f["beta"]):
        raise ConfigError("TRL field 'sync_ref_model' moves the reference model, and beta 0 trains without one "
                          "(TRL refuses it too); set beta above 0 or drop sync_ref_model")
    steps = whole_rollouts("ref_model_sync_steps", int(f["ref_model_sync_steps"]), updates_per_rollout, notes,
                           "the reference moves every {steps}")
    _set(raw, "algo.kl.ref_sync_steps", steps)
    _set(raw, "algo.kl.ref_mixup_alpha", float(f["ref_model_mixup_alpha"]))


def adaptive_entropy(f: dict[str, Any], raw: dict[str, Any], notes: list[str], updates_per_rollout: int) -> None:
    """use_adaptive_entropy (Skywork-OR1): TRL moves the coefficient after every optimizer update, we
    after every rollout (the same when a rollout makes one update, TRL's default)."""
    if not f.get("use_adaptive_entropy"):  # GRPOConfig's; RLOOConfig has none
        return
    _set(raw, "algo.policy_loss.entropy_target", float(f["entropy_target"]))
    for name in ("entropy_coef_delta", "entropy_coef_min", "entropy_coef_max"):
        _set(raw, f"algo.policy_loss.{name}", float(f[name]))
    if updates_per_rollout > 1:
        notes.append(f"use_adaptive_entropy moves the coefficient after each rollout here ({updates_per_rollout} "
                     "optimizer updates), after each update in TRL")
