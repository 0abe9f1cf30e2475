"""Config validation against the installed components, before anything starts.

Every check fails with one line that names the key and how to fix it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .algorithms import AGGREGATIONS
from .config import Config
from .errors import ConfigError
from .manager import RLHFPluginManager
from .types import (
    AdvantageEstimator,
    GenerationBackend,
    KLEstimator,
    LearnerBackend,
    PlacementStrategy,
    PolicyLoss,
    RewardFunction,
    WeightSyncMethod,
)



@dataclass
class Plan:
    """What validation resolved: reward functions and weights, and which roles run."""

    rewards: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    needs_reference: bool = False
    needs_critic: bool = False


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_ranges(c: Config) -> None:
    g, t, l, p = c.generation, c.train, c.learner, c.algo.policy_loss
    _require(t.steps >= 1, f"train.steps must be >= 1; got {t.steps}")
    _require(t.prompts_per_step >= 1, f"train.prompts_per_step must be >= 1; got {t.prompts_per_step}")
    _require(g.n_samples_per_prompt >= 1, f"generation.n_samples_per_prompt must be >= 1; got {g.n_samples_per_prompt}")
    _require(g.max_new_tokens >= 1, f"generation.max_new_tokens must be >= 1; got {g.max_new_tokens}")
    _require(g.temperature > 0, f"generation.temperature must be > 0; got {g.temperature}")
    _require(0 < g.top_p <= 1, f"generation.top_p must be in (0, 1]; got {g.top_p}")
    _require(g.top_k >= 0, f"generation.top_k must be >= 0 (0 disables it); got {g.top_k}")
    _require(l.lr > 0, f"learner.lr must be > 0; got {l.lr}")
    _require(l.epochs >= 1, f"learner.epochs must be >= 1; got {l.epochs}")
    _require(l.mini_batch_size >= 0, f"learner.mini_batch_size must be >= 0; got {l.mini_batch_size}")
    _require(l.micro_batch_size >= 0, f"learner.micro_batch_size must be >= 0; got {l.micro_batch_size}")
    _require(l.max_grad_norm >= 0, f"learner.max_grad_norm must be >= 0 (0 disables clipping); got {l.max_grad_norm}")
    _require(0 <= p.clip_low < 1, f"algo.policy_loss.clip_low must be in [0, 1); got {p.clip_low}")
    _require(p.clip_high >= 0, f"algo.policy_loss.clip_high must be >= 0; got {p.clip_high}")
    _require(
        p.dual_clip is None or p.dual_clip > 1,
        f"algo.policy_loss.dual_clip must be > 1 (or empty to disable); got {p.dual_clip}",
    )
    _require(
        p.aggregation in AGGREGATIONS,
        f"unknown loss aggregation '{p.aggregation}'; choose one of: {', '.join(AGGREGATIONS)}",
    )
    _require(c.algo.kl.coef >= 0, f"algo.kl.coef must be >= 0; got {c.algo.kl.coef}")
    _require(0 <= c.algo.advantage.gamma <= 1, f"algo.advantage.gamma must be in [0, 1]; got {c.algo.advantage.gamma}")
    _require(0 <= c.algo.advantage.lam <= 1, f"algo.advantage.lam must be in [0, 1]; got {c.algo.advantage.lam}")
    r, k, cr = c.reward, c.algo.kl, c.critic
    _require(r.overlong_buffer >= 0, f"reward.overlong_buffer must be >= 0; got {r.overlong_buffer}")
    _require(
        r.overlong_buffer <= g.max_new_tokens,
        f"reward.overlong_buffer ({r.overlong_buffer}) must not exceed generation.max_new_tokens ({g.max_new_tokens})",
    )
    _require(r.clip is None or r.clip > 0, f"reward.clip must be > 0 (or empty to disable); got {r.clip}")
    _require(r.filter_max_rounds >= 1, f"reward.filter_max_rounds must be >= 1; got {r.filter_max_rounds}")
    if r.filter_range is not None:
        _require(
            len(r.filter_range) == 2 and r.filter_range[0] < r.filter_range[1],
            f"reward.filter_range must be [low, high] with low < high; got {r.filter_range}",
        )
    _require(
        not r.dynamic_filtering or g.n_samples_per_prompt >= 2,
        "reward.dynamic_filtering compares samples of one prompt and needs generation.n_samples_per_prompt >= 2",
    )
    if k.controller == "adaptive":
        _require(k.coef > 0, "an adaptive KL controller needs a starting algo.kl.coef > 0")
        _require(k.target > 0, f"algo.kl.target must be > 0; got {k.target}")
        _require(k.horizon >= 1, f"algo.kl.horizon must be >= 1; got {k.horizon}")
    _require(
        0 < p.mismatch_low <= 1 <= p.mismatch_high,
        f"algo.policy_loss mismatch band must satisfy 0 < mismatch_low <= 1 <= mismatch_high; "
        f"got [{p.mismatch_low}, {p.mismatch_high}]",
    )
    _require(c.sync.bucket_mb >= 0, f"sync.bucket_mb must be >= 0 (0: one tensor per bucket); got {c.sync.bucket_mb}")
    _require(cr.lr > 0, f"critic.lr must be > 0; got {cr.lr}")
    _require(cr.value_clip is None or cr.value_clip > 0, f"critic.value_clip must be > 0 (or empty); got {cr.value_clip}")
    for key, folder in (("model.path", c.model.path), ("critic.path", cr.path)):
        if folder:
            _require(
                (Path(folder).expanduser() / "config.json").is_file(),
                f"{key} '{folder}' is not a save_pretrained folder (no config.json); "
                "give a local model folder or leave it empty",
            )
    if c.data.path:
        from .data import data_files

        data_files(Path(c.data.path).expanduser())


def choose_rewards(c: Config, pm: RLHFPluginManager) -> tuple[list[str], list[float]]:
    """Explicit names win; else the only reward a non-builtin plugin gives; else the task default."""
    names = list(c.reward.functions)
    if not names:
        rows = [r for r in pm.components.of(RewardFunction) if pm.infos.get(r.provider) is None
                or pm.infos[r.provider].source != "builtin"]
        if len(rows) == 1:
            names = [rows[0].name]
        elif len(rows) > 1:
            raise ConfigError(
                "plugins provide several reward functions (" + ", ".join(r.name for r in rows)
                + "); choose with --reward.functions NAME[,NAME]"
            )
        elif c.data.path is None:
            names = ["exact_match"]
        else:
            choices = ", ".join(pm.components.names(RewardFunction))
            raise ConfigError(f"no reward function chosen; set --reward.functions (available: {choices})")
    for name in names:
        pm.components.get(RewardFunction, name)
    weights = list(c.reward.weights) or [1.0] * len(names)
    _require(
        len(weights) == len(names),
        f"reward.weights has {len(weights)} values for {len(names)} reward functions; give one per function",
    )
    return names, weights


def validate(c: Config, pm: RLHFPluginManager) -> Plan:
    """Resolve every component name, check ranges and combinations, then let plugins check."""
    reg = pm.components
    placement = reg.get(PlacementStrategy, c.placement.strategy)
    reg.get(GenerationBackend, c.generation.backend)
    reg.get(LearnerBackend, c.learner.backend)
    c.sync.method = c.sync.method or placement.default_sync  # the saved config names it
    sync = reg.get(WeightSyncMethod, c.sync.method)
    if sync.same_process is not None and sync.same_process != placement.same_process:
        where = "in the learner's process" if sync.same_process else "in its own process"
        raise ConfigError(
            f"weight sync '{sync.name}' needs the engine {where}, which placement '{placement.name}' does not do; "
            f"use --sync.method {placement.default_sync}"
        )
    reg.get(PolicyLoss, c.algo.policy_loss.name)
    reg.get(KLEstimator, c.algo.kl.estimator)
    est = reg.get(AdvantageEstimator, c.algo.advantage.estimator)
    check_ranges(c)
    if est.needs_groups and c.generation.n_samples_per_prompt < 2:
        raise ConfigError(
            f"advantage estimator '{est.name}' compares samples of the same prompt and needs "
            f"generation.n_samples_per_prompt >= 2; got {c.generation.n_samples_per_prompt}"
        )
    plan = Plan()
    plan.rewards, plan.weights = choose_rewards(c, pm)
    c.reward.functions, c.reward.weights = list(plan.rewards), list(plan.weights)  # saved config is explicit
    plan.needs_reference = c.algo.kl.coef > 0
    if est.needs_critic and c.critic.enabled is False:
        raise ConfigError(
            f"advantage estimator '{est.name}' needs a critic, but critic.enabled is false; "
            "enable it or choose an estimator without one (group_norm, rloo, reinforce, ...)"
        )
    plan.needs_critic = est.needs_critic if c.critic.enabled is None else c.critic.enabled
    pm.configure(c)
    return plan

