"""Config validation against the installed components, before anything starts.

Every check fails with one line that names the key and how to fix it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.manager import RLHFPluginManager
from ..errors import ConfigError
from ..types import (
    AdvantageEstimator,
    Environment,
    GenerationBackend,
    KLEstimator,
    LearnerBackend,
    PlacementStrategy,
    PolicyLoss,
    RewardFunction,
    WeightSyncMethod,
)
from .checks import _require, check_ranges, check_staleness
from .schema import Config


@dataclass
class Plan:
    """What validation resolved, handed to the loop as it is: the component of every area (with
    its capabilities and providing plugin), the reward functions and weights, and which roles run."""

    placement: PlacementStrategy
    engine: GenerationBackend
    learner: LearnerBackend
    sync: WeightSyncMethod
    estimator: AdvantageEstimator
    policy_loss: PolicyLoss
    kl: KLEstimator
    #: component area and name -> the plugin that provided it
    providers: dict[str, str] = field(default_factory=dict)
    rewards: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    needs_reference: bool = False
    needs_critic: bool = False
    #: generation engines the run starts (the backend's ``workers``)
    engine_workers: int = 1
    #: (run directory, checkpoint folder) when the run continues from a checkpoint
    resume: tuple[Path, Path] | None = None
    #: the environment of --env.name (rows may name others in --env.column)
    environment: Environment | None = None
    #: the config gave train.steps (it then decides the run's length over train.episodes)
    steps_given: bool = False
    #: what the run chose for the user and why (printed with the config)
    notes: list[str] = field(default_factory=list)
    #: the policy starts away from the engine's checkpoint (a trained LoRA adapter): the engine gets the
    #: learner's weights before the first rollout
    actor_moved: bool = False

    def provider(self, component: Any) -> str:
        return self.providers.get(f"{component.area}:{component.name}", "?")

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles to place, in start order."""
        return ("generation", "actor", *("reference",) * self.needs_reference, *("critic",) * self.needs_critic,
                "reward")


def choose_rewards(c: Config, pm: RLHFPluginManager, plugin_env: bool = False) -> tuple[list[str], list[float]]:
    """Explicit names win; else none when reward models or servers score; else the only reward the
    plugins the run asked for give (``--plugin``, ``plugins:``, Python objects -- never a package
    that is merely installed: installing one must not change what a plain run trains on); else a
    plugin environment's own reward (``plugin_env``); else the task default. Returns function names
    and one weight per source."""
    names = list(c.reward.functions)
    others = len(c.reward.models) + (1 if c.reward.remote_urls else 0)
    if not names and not others:
        rows = [r for r in pm.components.of(RewardFunction)
                if not pm.is_builtin(r.provider) and r.provider in pm.requested]
        if len(rows) == 1:
            names = [rows[0].name]
        elif len(rows) > 1:
            raise ConfigError(
                "plugins provide several reward functions (" + ", ".join(r.name for r in rows)
                + "); choose with --reward.functions NAME[,NAME]"
            )
        elif plugin_env or (c.env.name and c.data.path is not None and not str(c.data.path).startswith("builtin:")):
            names = ["env_reward"]
        elif c.data.path is None or str(c.data.path).startswith("builtin:"):
            names = ["exact_match"]  # the built-in tasks have labels
        else:
            choices = ", ".join(pm.components.names(RewardFunction))
            raise ConfigError(f"no reward function chosen; set --reward.functions (available: {choices})")
    for key, listed in (("reward.functions", names), ("eval.reward_functions", c.eval.reward_functions)):
        for name in listed:
            try:
                pm.components.get(RewardFunction, name)
            except ConfigError as exc:
                raise ConfigError(f"{exc} (--{key})") from None
    sources = len(names) + others
    weights = list(c.reward.weights) or [1.0] * sources
    _require(
        len(weights) == sources,
        f"reward.weights has {len(weights)} values for {sources} reward sources ({len(names)} functions, "
        f"{len(c.reward.models)} models{', the remote servers' if c.reward.remote_urls else ''}); give one per source",
    )
    return names, weights


def _resolve(c: Config, pm: RLHFPluginManager) -> Plan:
    reg = pm.components
    providers: dict[str, str] = {}

    def get(cls: type, name: str, key: str) -> Any:
        try:
            comp = reg.get(cls, name)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (--{key})") from None
        providers[f"{comp.area}:{comp.name}"] = reg.provider(cls, name)
        return comp

    placement = get(PlacementStrategy, c.placement.strategy, "placement.strategy")
    sync_name = c.sync.method or placement.sync_for(c)
    plan = Plan(
        placement=placement,
        engine=get(GenerationBackend, c.generation.backend, "generation.backend"),
        learner=get(LearnerBackend, c.learner.backend, "learner.backend"),
        sync=get(WeightSyncMethod, sync_name, "sync.method"),
        estimator=get(AdvantageEstimator, c.algo.advantage.estimator, "algo.advantage.estimator"),
        policy_loss=get(PolicyLoss, c.algo.policy_loss.name, "algo.policy_loss.name"),
        kl=get(KLEstimator, c.algo.kl.estimator, "algo.kl.estimator"),
        providers=providers,
    )
    # defaults that depend on the chosen components, written back so the saved config is explicit
    c.sync.method = sync_name
    c.algo.policy_loss.aggregation = c.algo.policy_loss.aggregation or plan.policy_loss.default_aggregation
    if c.algo.policy_loss.norm_length is None:  # the longest completion: a turn, or a whole trajectory
        c.algo.policy_loss.norm_length = c.env.max_total_tokens if c.env.name else c.generation.max_new_tokens
    return plan


def check_combinations(c: Config, plan: Plan) -> None:
    """Every combination of components decided once, from their declared capabilities."""
    placement, sync, engine, est = plan.placement, plan.sync, plan.engine, plan.estimator
    if sync.same_process is not None and sync.same_process != placement.in_one_process(c):
        where = "in the learner's process" if sync.same_process else "in its own process"
        raise ConfigError(
            f"weight sync '{sync.name}' needs the engine {where}, which placement '{placement.name}' does not do; "
            f"use --sync.method {placement.sync_for(c)}"
        )
    if sync.needs_colocation and not placement.colocates(c):
        hint = f" ({placement.colocate_hint})" if placement.colocate_hint else ""
        raise ConfigError(
            f"weight sync '{sync.name}' needs the engine on the learner's node and device, which placement "
            f"'{placement.name}' does not give with this config{hint}; or use --sync.method {placement.sync_for(c)}"
        )
    if sync.needs_adapter and not engine.supports_adapter:
        raise ConfigError(f"weight sync '{sync.name}' moves a LoRA adapter alone, but generation backend "
                          f"'{engine.name}' cannot load adapters; choose another --sync.method")
    check_compile(c, plan)
    owner = next((k for k, v in (("learner", c.learner), ("critic", c.critic)) if v.optimizer == "adafactor"), "")
    if owner and not plan.learner.whole_parameters:
        raise ConfigError(f"{owner}.optimizer adafactor factors each weight matrix's second moment by its rows and "
                          f"columns, which the {plan.learner.name} learner's flattened or sharded parameters do not "
                          "keep: use --learner.backend torch, or another optimizer")
    if c.model.fp32_lm_head and not plan.learner.float32_head:
        raise ConfigError(f"model.fp32_lm_head: the '{plan.learner.name}' learner trains every weight in "
                          f"model.dtype; use --learner.backend torch (or fsdp) or drop --model.fp32_lm_head")
    refused = engine.refuses_sampling(c) if engine.refuses_sampling is not None else None
    if refused:
        raise ConfigError(refused)
    if plan.engine_workers < 1:
        raise ConfigError(f"generation backend '{engine.name}' asks for {plan.engine_workers} engines; it needs >= 1")
    if plan.engine_workers > 1 and not placement.multi_rank:
        raise ConfigError(f"{plan.engine_workers} generation engines need a placement that runs several ranks "
                          f"per role; placement '{placement.name}' runs one (use --placement.strategy ray)")
    if est.needs_groups and c.generation.n_samples_per_prompt < 2:
        raise ConfigError(
            f"advantage estimator '{est.name}' compares samples of the same prompt and needs "
            f"generation.n_samples_per_prompt >= 2; got {c.generation.n_samples_per_prompt}"
        )
    check_staleness(c)
    if est.needs_critic and c.critic.enabled is False:
        raise ConfigError(
            f"advantage estimator '{est.name}' needs a critic, but critic.enabled is false; "
            "enable it or choose an estimator without one (group_norm, rloo, reinforce, ...)"
        )


def resolve_environment(c: Config, pm: RLHFPluginManager, plan: Plan) -> None:
    """``--env.name``'s environment (else the only one a non-builtin plugin gives, as an OpenRLHF
    agent file does), and its default data and model when the run gives none."""
    if not c.env.name:
        rows = [r for r in pm.components.of(Environment) if not pm.is_builtin(r.provider)]
        if len(rows) != 1:
            return
        c.env.name = rows[0].name
    try:
        env = pm.components.get(Environment, c.env.name)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (--env.name)") from None
    plan.environment = env
    plan.providers[f"{env.area}:{env.name}"] = pm.components.provider(Environment, env.name)
    if c.data.path is None and env.default_data:
        c.data.path = env.default_data
    if c.model.path is None and env.default_model is not None:
        c.model.path = env.default_model()
    _require(not c.generation.partial_rollout, "generation.partial_rollout continues one long generation across "
                                               "weight updates, which multi-turn rollouts do not do; drop it with "
                                               "--env.name")


def check_compile(c: Config, plan: Plan) -> None:
    """--learner.compile and what it takes: a learner that compiles, and for CUDA graphs one that allows them."""
    if c.learner.compile and not plan.learner.compiles:
        raise ConfigError(f"learner.compile: the '{plan.learner.name}' learner does not compile its model; use "
                          "--learner.backend torch (or fsdp) or drop --learner.compile")
    for name, default in (("compile_scope", "blocks"), ("compile_mode", "default")):
        if getattr(c.learner, name) != default and not c.learner.compile:
            raise ConfigError(f"learner.{name} {getattr(c.learner, name)} says how --learner.compile compiles; "
                              f"add --learner.compile true or drop --learner.{name}")
    if c.learner.compile_mode != "default" and not plan.learner.graphs:
        from ..models.compiled import GRAPHED_MODES  # torch: only when a mode is asked for

        if c.learner.compile_mode in GRAPHED_MODES:
            raise ConfigError(f"learner.compile_mode {c.learner.compile_mode} replays CUDA graphs, which the "
                              f"'{plan.learner.name}' learner does not allow (its weights move between steps); use "
                              "--learner.compile_mode default (or max-autotune-no-cudagraphs) or --learner.backend "
                              "torch")


def check_router_loss(c: Config) -> None:
    """--learner.router_aux_loss_coef weights a mixture of experts' load-balancing loss: a model with routers."""
    if not c.learner.router_aux_loss_coef:
        return
    from ..models.model_shape import ModelShape
    from ..models.tiny_model import default_model_path

    path = c.model.path or default_model_path(quiet=True)
    try:
        routed = ModelShape.of_folder(path, c.model.trust_remote_code).router_loss
    except (OSError, ValueError):
        return  # loading the model says what is wrong with the folder
    if not routed:
        raise ConfigError(f"learner.router_aux_loss_coef {c.learner.router_aux_loss_coef:g} weights a mixture of "
                          f"experts' load-balancing loss, and the model at '{path}' has no routers that report it "
                          "(no output_router_logits in its config); drop --learner.router_aux_loss_coef")


def check_kl_ratio(c: Config) -> None:
    """--algo.kl.ratio and --algo.kl.unbiased_gradient shape the KL loss term, which KL in the reward does
    not have; both weigh its gradient by the policy ratio."""
    k = c.algo.kl
    _require(k.ratio == "none" or not k.in_reward,
             f"algo.kl.ratio {k.ratio} weights the KL loss term, and algo.kl.in_reward puts KL in the "
             "reward instead; drop one of them")
    _require(not k.unbiased_gradient or not k.in_reward,
             "algo.kl.unbiased_gradient shapes the KL loss term's gradient, and algo.kl.in_reward puts KL in the "
             "reward instead; drop one of them")
    _require(not k.unbiased_gradient or k.ratio == "none",
             f"algo.kl.unbiased_gradient weighs the KL gradient by pi/pi_old itself; drop --algo.kl.ratio {k.ratio}")


def check_reference_sync(c: Config, plan: Plan) -> None:
    """--algo.kl.ref_sync_steps needs a reference and one update at a time."""
    if not c.algo.kl.ref_sync_steps:
        return
    _require(plan.needs_reference, "algo.kl.ref_sync_steps moves the reference model, but algo.kl.coef 0 runs "
                                   "without one; set --algo.kl.coef above 0 or drop ref_sync_steps")
    _require(not c.train.max_staleness, "algo.kl.ref_sync_steps moves the reference while rollouts made ahead "
                                        "read it (train.max_staleness); drop one of them")


def validate(c: Config, pm: RLHFPluginManager) -> Plan:
    """Resolve every component once, check ranges and combinations, then let plugins check."""
    plan = _resolve(c, pm)
    resolve_environment(c, pm, plan)
    check_ranges(c)
    plan.engine_workers = plan.engine.num_workers(c)
    check_combinations(c, plan)
    env = plan.environment
    plan.rewards, plan.weights = choose_rewards(c, pm, env is not None and not pm.is_builtin(plan.provider(env)))
    c.reward.functions, c.reward.weights = list(plan.rewards), list(plan.weights)  # saved config is explicit
    plan.needs_reference = c.algo.kl.coef > 0
    check_reference_sync(c, plan)
    check_kl_ratio(c)
    check_router_loss(c)
    plan.needs_critic = plan.estimator.needs_critic if c.critic.enabled is None else c.critic.enabled
    if c.critic.freezing_steps and not plan.needs_critic:
        raise ConfigError(f"critic.freezing_steps trains the critic alone for a while, but this run has no critic "
                          f"(estimator '{plan.estimator.name}'); drop it or use --algo.advantage.estimator gae")
    pm.configure(c, plan)
    return plan
