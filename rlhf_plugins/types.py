"""Registration dataclasses: what a plugin yields from a registration hook.

Every area of the RL loop has one frozen dataclass. A plugin describes a component
(its name, what it needs, and the callable or factory that builds it); the manager
collects them once at start-up and the config picks components by name.

Heavy libraries are never imported here: factories import them when called.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .component import _NAME, Component, _check_callable

__all__ = ["AREAS", "AdvantageEstimator", "Component", "Environment", "GenerationBackend", "KLEstimator",
           "LearnerBackend", "PlacementStrategy", "PolicyLoss", "RewardFunction", "WeightSyncMethod", "_NAME"]


@dataclass(frozen=True)
class PlacementStrategy(Component):
    """Where every role lives. ``factory(ctx: PlacementContext)`` returns a
    :class:`~rlhf_plugins.Placement`.

    Capabilities, checked once by ``validate``: ``same_process`` (roles share the driver's
    process), ``multi_rank`` (a role may have several ranks), ``colocated(config)`` (the actor
    and the generation engine share a node and device with this config; ``colocate_hint`` says
    how to get that), ``shared_process(config)`` (the actor and the engine share one process with
    this config, though the placement's roles otherwise do not: in-process weight sync then applies
    and ``shared_sync`` is the default). ``default_sync`` names the weight-sync method used when none
is configured otherwise.
    ``processes(config, roles)`` says how roles share processes and how many ranks each has, and
    ``node_memory(config)`` the memory of the node they go to when it is known before launch: the
    memory plan (:mod:`rlhf_plugins.training.memory_plan`) adds up needs per process and per node.
    """

    area: ClassVar[str] = "placement strategy"
    factory: Callable[..., Any]
    same_process: bool = field(default=True, kw_only=True)
    multi_rank: bool = field(default=False, kw_only=True)
    colocated: Callable[[Any], bool] | None = field(default=None, kw_only=True)
    colocate_hint: str = field(default="", kw_only=True)
    default_sync: str = field(default="inprocess", kw_only=True)
    shared_process: Callable[[Any], bool] | None = field(default=None, kw_only=True)
    shared_sync: str = field(default="inprocess", kw_only=True)
    processes: Callable[[Any, tuple[str, ...]], list[tuple[tuple[str, ...], int]]] | None = field(
        default=None, kw_only=True)
    node_memory: Callable[[Any], int | None] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_callable(self, "factory")

    def colocates(self, config: Any) -> bool:
        if self.colocated is not None:
            return bool(self.colocated(config))
        return self.same_process

    def in_one_process(self, config: Any) -> bool:
        """Whether the actor and the generation engine run in one process with ``config``."""
        return self.same_process or (self.shared_process is not None and bool(self.shared_process(config)))

    def process_groups(self, config: Any, roles: tuple[str, ...]) -> list[tuple[tuple[str, ...], int]]:
        """How ``roles`` share processes: (roles in one process, how many such processes -- one per
        rank). Default: all in one process when ``same_process``, else one process per role."""
        if self.processes is not None:
            return list(self.processes(config, roles))
        return [(tuple(roles), 1)] if self.same_process else [((r,), 1) for r in roles]

    def memory_of_node(self, config: Any) -> int | None:
        """Bytes of memory of the node the roles are placed on, when known before launch."""
        return self.node_memory(config) if self.node_memory is not None else None

    def sync_for(self, config: Any) -> str:
        """The weight-sync method used when none is configured."""
        return self.shared_sync if not self.same_process and self.in_one_process(config) else self.default_sync


@dataclass(frozen=True)
class GenerationBackend(Component):
    """Turns prompts into samples. ``factory(ctx: BackendContext)`` returns a
    :class:`~rlhf_plugins.GenerationEngine`.

    Capabilities: ``supports_adapter`` (the engine has ``load_adapter``: LoRA adapters can be
    synced alone); ``supports_shared_weights`` (the engine has ``share_weights``: its parameters can
    be the learner's own tensors); ``streams_weights`` (the engine has ``load_weights_part`` and
    ``finish_weights``: a bucketed sync loads as it arrives, staging buckets rather than a copy of
    the model); ``workers(config)`` how many engines the run wants (default 1);
    ``max_length(config)`` the longest prompt + completion the engine will take (``None``: no
    limit), named by the config key ``max_length_key`` -- checked against the data before start.
    ``memory(inputs: MemoryInputs) -> {item: bytes}`` the engine's analytic need per engine (an item
    named ``imports`` is the fixed cost of its libraries, shown apart). ``starts_empty(config)``:
    the engine starts without the checkpoint's weights under this config, so the loop syncs the
    learner's weights into it before the first generation. ``refuses_sampling(config)``: the line
    naming a sampling setting the engine would refuse mid-run (``None``: it takes them all), checked
    before start.
    """

    area: ClassVar[str] = "generation backend"
    factory: Callable[..., Any]
    supports_adapter: bool = field(default=False, kw_only=True)
    supports_shared_weights: bool = field(default=False, kw_only=True)
    streams_weights: bool = field(default=False, kw_only=True)
    workers: Callable[[Any], int] | None = field(default=None, kw_only=True)
    max_length: Callable[[Any], int | None] | None = field(default=None, kw_only=True)
    max_length_key: str = field(default="", kw_only=True)
    memory: Callable[[Any], dict[str, int]] | None = field(default=None, kw_only=True)
    starts_empty: Callable[[Any], bool] | None = field(default=None, kw_only=True)
    refuses_sampling: Callable[[Any], str | None] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_callable(self, "factory")

    def num_workers(self, config: Any) -> int:
        return int(self.workers(config)) if self.workers is not None else 1


@dataclass(frozen=True)
class RewardFunction(Component):
    """Scores completions.

    Give ``func`` with TRL's signature ``func(prompts, completions, **kwargs) ->
    list[float | None]`` (``kwargs`` carries every other dataset column, e.g.
    ``label``), or ``factory(config)`` returning such a callable when the reward
    needs set-up (a reward model, an HTTP client).
    """

    area: ClassVar[str] = "reward function"
    func: Callable[..., Any] | None = None
    factory: Callable[..., Any] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.func is None) == (self.factory is None):
            raise TypeError(f"reward function {self.name!r}: give exactly one of 'func' or 'factory'")
        _check_callable(self, "func" if self.func is not None else "factory")

    def build(self, config: Any) -> Callable[..., Any]:
        return self.func if self.func is not None else self.factory(config)


@dataclass(frozen=True)
class AdvantageEstimator(Component):
    """Turns rewards (and values) into advantages and returns.

    ``compute(inputs: AdvantageInputs) -> (advantages, returns)``, both ``[B, T]``
    tensors over completion tokens. ``needs_critic`` / ``needs_groups`` let config
    validation reject impossible combinations before anything starts.
    """

    area: ClassVar[str] = "advantage estimator"
    compute: Callable[..., Any]
    needs_critic: bool = field(default=False, kw_only=True)
    needs_groups: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_callable(self, "compute")


@dataclass(frozen=True)
class PolicyLoss(Component):
    """Policy-gradient surrogate. ``compute(inputs: PolicyLossInputs, options)``
    returns ``(per_token_loss [B, T], metrics)``; aggregation over tokens and
    sequences is applied by the objective, so every loss supports every mode.
    ``default_aggregation`` is used when the user sets none."""

    area: ClassVar[str] = "policy loss"
    compute: Callable[..., Any]
    default_aggregation: str = field(default="token-mean", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_callable(self, "compute")


@dataclass(frozen=True)
class KLEstimator(Component):
    """Per-token estimate of KL(policy || reference):
    ``compute(logprobs, ref_logprobs) -> [B, T]``."""

    area: ClassVar[str] = "kl estimator"
    compute: Callable[..., Any]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_callable(self, "compute")


@dataclass(frozen=True)
class LearnerBackend(Component):
    """Owns a trainable model and its optimizer. ``factory(ctx: BackendContext)`` returns a
    :class:`~rlhf_plugins.Learner`; ``ctx.load_model()`` loads the role's model through the
    ``rlhf_load_model`` hook when the learner is ready for it (ZeRO-3 sets up partitioning
    first). ``multi_rank``: the learner can run several data-parallel ranks. ``memory(inputs:
    MemoryInputs) -> {item: bytes}``: its analytic need per rank (weights, gradients, optimizer
    states in their dtypes and shards, activations, logits), for the memory plan. ``live_weights``:
    the learner offers ``live_weights()``, its parameters themselves, updated in place.
    ``shards_reference``: built for the role ``"reference"`` it is a frozen sharded model (no
    optimizer) whose ``logprobs`` the reference role serves, each rank holding 1/N of it.
    ``shards(config) -> int``: how far the learner already shards its states over its ranks with this
    config, in ZeRO's stages (1: optimizer states, 2: and gradients, 3: and weights; 0 or no function:
    nothing), so the memory plan tells it to spread them over more ranks rather than to shard them.
    ``compiles``: the learner honours ``--learner.compile`` (else the config is refused). ``graphs``:
    its compiled modules may replay CUDA graphs (``--learner.compile_mode reduce-overhead``): their
    weights keep their memory from one step to the next. ``float32_head``: the learner trains a 16-bit
    model whose output head is float32 (``--model.fp32_lm_head``; else the config is refused).
    ``whole_parameters``: its optimizer steps whole, unflattened parameters, as a factored optimizer
    (``--learner.optimizer adafactor``) needs (else the config is refused)."""

    area: ClassVar[str] = "learner backend"
    factory: Callable[..., Any]
    multi_rank: bool = field(default=False, kw_only=True)
    memory: Callable[[Any], dict[str, int]] | None = field(default=None, kw_only=True)
    live_weights: bool = field(default=False, kw_only=True)
    shards_reference: bool = field(default=False, kw_only=True)
    shards: Callable[[Any], int] | None = field(default=None, kw_only=True)
    compiles: bool = field(default=False, kw_only=True)
    graphs: bool = field(default=False, kw_only=True)
    float32_head: bool = field(default=False, kw_only=True)
    whole_parameters: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_callable(self, "factory")


@dataclass(frozen=True)
class WeightSyncMethod(Component):
    """Moves new actor weights into the generation engine. ``factory(config)`` returns a
    :class:`~rlhf_plugins.WeightSync`.

    Requirements, checked once by ``validate`` against the placement and the engine:
    ``same_process`` (True: the engine must live in the learner's process; False: it must not;
    None: either), ``needs_colocation`` (the engine shares the learner's node and device),
    ``needs_adapter`` (only a LoRA adapter moves: the engine must support adapters).
    ``shares_weights(config)``: with this config the engine reads the learner's own parameters
    (when the engine and learner allow it), so the process holds one copy of the weights.
    ``staging``: the roles (``"generation"``, ``"actor"``) that hold a whole extra copy of the weights
    during a sync (received buckets kept until they load in one pass; shared buffers), for the memory
    plan; an engine that ``streams_weights`` holds about two buckets and one layer instead.
    """

    area: ClassVar[str] = "weight sync method"
    factory: Callable[..., Any]
    same_process: bool | None = field(default=None, kw_only=True)
    needs_colocation: bool = field(default=False, kw_only=True)
    needs_adapter: bool = field(default=False, kw_only=True)
    shares_weights: Callable[[Any], bool] | None = field(default=None, kw_only=True)
    staging: tuple[str, ...] = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_callable(self, "factory")


@dataclass(frozen=True)
class Environment(Component):
    """A multi-turn environment (``--env.name``, or a dataset column per row).

    ``factory()`` returns a fresh instance for one trajectory, in either of two shapes:

    * TRL's: a class whose public methods are tools the model calls, ``reset(**row)`` returning
      ``None`` or text appended to the last user message, and optionally ``get_reward()``;
    * OpenRLHF's agent: async ``reset(states)`` returning ``{"observation": text}`` and async
      ``step(states)`` returning ``{"rewards", "environment_feedback", "done", ...}``.

    ``factory()`` may also return ``None``: the model then has the standalone ``tools`` alone.
    ``tools`` are offered beside the instance's own methods (TRL's ``tools=[...]``).
    ``default_data`` (a data path) and ``default_model`` (a callable returning a model folder) are
    used when the run gives none, so a builtin environment runs with ``--env.name`` alone.
    """

    area: ClassVar[str] = "environment"
    factory: Callable[..., Any]
    tools: tuple[Callable[..., Any], ...] = field(default=(), kw_only=True)
    default_data: str | None = field(default=None, kw_only=True)
    default_model: Callable[[], str] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_callable(self, "factory")


#: registration hook name -> component class, in the order of the loop.
AREAS: dict[str, type[Component]] = {
    "rlhf_placement_strategies": PlacementStrategy,
    "rlhf_generation_backends": GenerationBackend,
    "rlhf_reward_functions": RewardFunction,
    "rlhf_advantage_estimators": AdvantageEstimator,
    "rlhf_policy_losses": PolicyLoss,
    "rlhf_kl_estimators": KLEstimator,
    "rlhf_learner_backends": LearnerBackend,
    "rlhf_weight_sync_methods": WeightSyncMethod,
    "rlhf_environments": Environment,
}
