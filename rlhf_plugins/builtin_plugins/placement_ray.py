"""Builtin placement ``ray``: placement groups per role on a Ray cluster.

Adds the ``ray`` config section (``--ray.address``, ``--ray.strategy``,
``--ray.colocate``, ``--ray.actor_workers`` ...) and checks it when chosen.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from .._lazy import Lazy
from .._markers import hookimpl
from ..errors import ConfigError
from ..settings import setting
from ..types import PlacementStrategy


@dataclass
class RayOptions:
    #: cluster address; empty: RAY_ADDRESS, the cluster of a `ray job submit`, else a local cluster
    address: str | None = None
    #: placement-group strategy: PACK | STRICT_PACK | SPREAD | STRICT_SPREAD
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    #: roles sharing bundles: none | actor_ref | critic_reward | all (with the generation engine);
    #: hybrid: actor, reference and engine in one process (one rank each, synchronous training)
    colocate: Literal["none", "actor_ref", "critic_reward", "all", "hybrid"] = "none"
    #: data-parallel ranks of the actor (the DeepSpeed learner shards across them)
    actor_workers: int = setting(1, ge=1)
    #: data-parallel ranks of the critic
    critic_workers: int = setting(1, ge=1)
    #: ranks of the reference model (each scores a share of the batch)
    reference_workers: int = setting(1, ge=1)
    #: ranks of the reward role; reward models score data-parallel across them
    reward_workers: int = setting(1, ge=1)
    #: GPUs of one bundle (one rank); 0 on a CPU-only cluster
    gpus_per_worker: float = setting(1.0, ge=0)
    #: CPUs of one bundle (one rank)
    cpus_per_worker: float = setting(1.0, gt=0)
    #: seconds to wait for placement groups to be ready; a role's start may take the longer of this and
    #: call_timeout
    ready_timeout: float = setting(60.0, gt=0)
    #: seconds to wait for --ray.address to answer
    connect_timeout: float = setting(10.0, gt=0)
    #: CPUs a local cluster started here declares (empty: max(8, cores))
    local_num_cpus: int | None = setting(None, ge=1)
    #: fake GPUs declared to a local cluster (placement without GPUs: tests, laptops)
    local_num_gpus: int = setting(0, ge=0)
    #: forward the actors' stdout / stderr to this terminal
    log_to_driver: bool = False
    #: restarts of dead role actors per run (killed, or their node lost); each continues from the
    #: latest checkpoint (one is written before the first step when this is > 0)
    max_restarts: int = setting(0, ge=0)
    #: seconds a call to a role may take before the run stops naming the role, rank and method (0: no limit)
    call_timeout: float = setting(3600.0, ge=0)


@hookimpl
def rlhf_add_options(options: Any) -> None:
    options.add_section("ray", RayOptions)


def _colocated(config: Any) -> bool:
    return config.section("ray").colocate in ("all", "hybrid")


def _hybrid(config: Any) -> bool:
    return config.section("ray").colocate == "hybrid"


@hookimpl
def rlhf_configure(config: Any, plan: Any) -> None:
    if plan.placement.factory is not PLACEMENT:
        return
    o = config.section("ray")
    if not plan.learner.multi_rank and (o.actor_workers > 1 or o.critic_workers > 1):
        raise ConfigError(f"learner backend '{plan.learner.name}' runs one rank; choose a multi-rank learner "
                          f"(--learner.backend deepspeed) for ray.actor_workers {o.actor_workers} / "
                          f"ray.critic_workers {o.critic_workers}")
    if o.colocate == "hybrid":
        ranks = {"ray.actor_workers": o.actor_workers, "ray.reference_workers": o.reference_workers,
                 "generation engines": plan.engine_workers}
        if any(n != 1 for n in ranks.values()):
            given = ", ".join(f"{k} {n}" for k, n in ranks.items())
            raise ConfigError(f"--ray.colocate hybrid hosts the actor, reference and engine in one process and "
                              f"takes one rank of each (got {given}); use --ray.colocate all for several ranks")
        if config.train.max_staleness:
            raise ConfigError("--ray.colocate hybrid runs generation and training in turn in one process; "
                              "asynchronous training (train.max_staleness >= 1) needs another --ray.colocate")
    batch = config.train.prompts_per_step * config.generation.n_samples_per_prompt
    for name, n in (("actor_workers", o.actor_workers), ("critic_workers", o.critic_workers)):
        if config.train.prompts_per_step % n:
            raise ConfigError(f"train.prompts_per_step ({config.train.prompts_per_step}) must be a multiple of "
                              f"ray.{name} ({n}) so every rank trains on whole prompt groups")
        mini = config.learner.mini_batch_size
        if mini and (mini % n or batch % mini):
            raise ConfigError(f"learner.mini_batch_size must divide the rollout ({batch}) and be a multiple of "
                              f"ray.{name}")


PLACEMENT = Lazy("rlhf_plugins.placement.ray_placement:RayPlacement")


@hookimpl
def rlhf_placement_strategies() -> Iterable[PlacementStrategy]:
    yield PlacementStrategy(
        "ray",
        factory=PLACEMENT,
        description="one placement group per role (or colocated roles) on a Ray cluster",
        requires=("ray",),
        extra="ray",
        same_process=False,
        multi_rank=True,
        colocated=_colocated,
        colocate_hint="--ray.colocate all",
        default_sync="broadcast",
        shared_process=_hybrid,
        processes=_processes,
        node_memory=_local_cluster_memory,
    )


def _processes(config: Any, roles: tuple[str, ...]) -> list[tuple[tuple[str, ...], int]]:
    """One process per rank of each role; under --ray.colocate hybrid the actor, reference and engine
    share one."""
    o = config.section("ray")
    ranks = {"actor": o.actor_workers, "critic": o.critic_workers, "reference": o.reference_workers,
             "reward": o.reward_workers, "generation": 1}
    shared = tuple(r for r in ("actor", "reference", "generation") if r in roles) if _hybrid(config) else ()
    out = [(shared, 1)] if shared else []
    return out + [((r,), ranks.get(r, 1)) for r in roles if r not in shared]


def _local_cluster_memory(config: Any) -> int | None:
    """A cluster this run starts lives on this machine, and Ray's memory monitor kills the newest task
    once the node is 95% full (RAY_memory_usage_threshold): that much of it. A cluster joined by
    address is sized after joining."""
    import os

    if config.section("ray").address or os.environ.get("RAY_ADDRESS"):
        return None
    from ..models.memory import this_machine

    return int(this_machine() * float(os.environ.get("RAY_memory_usage_threshold", "0.95")))
