"""Builtin placement ``ray``: placement groups per role on a Ray cluster.

Adds the ``ray`` config section (``--ray.address``, ``--ray.strategy``,
``--ray.colocate``, ``--ray.actor_workers`` ...) and checks it when chosen.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal

from .._lazy import Lazy
from .._markers import hookimpl
from ..errors import ConfigError
from ..types import PlacementStrategy


@dataclass
class RayOptions:
    #: cluster address; empty: RAY_ADDRESS, the cluster of a `ray job submit`, else a local cluster
    address: str | None = None
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    #: roles sharing bundles: none | actor_ref | critic_reward | all (with the generation engine)
    colocate: Literal["none", "actor_ref", "critic_reward", "all"] = "none"
    #: data-parallel ranks per role (the DeepSpeed learner shards across them)
    actor_workers: int = 1
    critic_workers: int = 1
    reference_workers: int = 1
    #: resources of one bundle (one rank); 0 GPUs on a CPU-only cluster
    gpus_per_worker: float = 1.0
    cpus_per_worker: float = 1.0
    #: seconds to wait for placement groups / for a remote address to answer
    ready_timeout: float = 60.0
    connect_timeout: float = 10.0
    #: a local cluster started here: CPUs to declare (empty: max(8, cores)) and fake GPUs (tests, laptops)
    local_num_cpus: int | None = None
    local_num_gpus: int = 0
    log_to_driver: bool = False


@hookimpl
def rlhf_add_options(options: Any) -> None:
    options.add_section("ray", RayOptions)


@hookimpl
def rlhf_configure(config: Any) -> None:
    if config.placement.strategy != "ray":
        return
    o = config.section("ray")
    if config.learner.backend == "torch" and (o.actor_workers > 1 or o.critic_workers > 1):
        raise ConfigError("the torch learner runs in one process; use --learner.backend deepspeed for "
                          f"ray.actor_workers {o.actor_workers} / ray.critic_workers {o.critic_workers}")
    batch = config.train.prompts_per_step * config.generation.n_samples_per_prompt
    for name, n in (("actor_workers", o.actor_workers), ("critic_workers", o.critic_workers)):
        if config.train.prompts_per_step % n:
            raise ConfigError(f"train.prompts_per_step ({config.train.prompts_per_step}) must be a multiple of "
                              f"ray.{name} ({n}) so every rank trains on whole prompt groups")
        if config.learner.mini_batch_size and (config.learner.mini_batch_size % n or batch % config.learner.mini_batch_size):
            raise ConfigError(f"learner.mini_batch_size must divide the rollout ({batch}) and be a multiple of ray.{name}")


@hookimpl
def rlhf_placement_strategies() -> Iterable[PlacementStrategy]:
    yield PlacementStrategy(
        "ray",
        factory=Lazy("rlhf_plugins.placement.ray_placement:RayPlacement"),
        description="one placement group per role (or colocated roles) on a Ray cluster",
        requires=("ray",),
        extra="ray",
        same_process=False,
        default_sync="broadcast",
    )
