"""A run's set-up: every role started where its placement puts it, then the algorithm's parts
(estimator, KL estimator and controller, objectives, reward shaping, prompt sampler, sampling
parameters), all resolved once so a step calls plain functions."""
from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch

from .._lazy import resolve
from ..algorithms.entropy_control import make_entropy_coef
from ..algorithms.kl_control import make_controller
from ..algorithms.objective import Objective
from ..algorithms.shaping import RewardShaper
from ..algorithms.value import ValueObjective
from ..data.sampler import PromptSampler
from ..environments import make_env_runner
from ..protocols import PlacementContext, SamplingParams
from .reward_role import RewardRole
from .roles import CriticRole, GenerationRole, PolicyRole, ReferenceRole

if TYPE_CHECKING:
    from .loop import Trainer


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def create_roles(trainer: Trainer) -> None:
    """The placement, then each role in start order (a placement may start them concurrently:
    ``ready()`` waits for all), then the multi-turn environment runner."""
    c, plan, spec, path = trainer.config, trainer.plan, trainer.pm.spec, trainer.model_path
    if c.train.num_threads:
        torch.set_num_threads(c.train.num_threads)
    seed_everything(c.train.seed)
    accelerated = ("generation", "actor", "reference", "critic", *(("reward",) if c.reward.models else ()))
    ctx = PlacementContext(c, plan.roles, workers={"generation": plan.engine_workers}, plugin_spec=spec,
                           accelerated=accelerated)
    trainer.placement = resolve(plan.placement.factory)(ctx)
    create = trainer.placement.create_role
    trainer.engine = create("generation", GenerationRole, c, spec, path, plan.engine, plan.provider(plan.engine),
                            plan.sync.needs_adapter)
    learner = (plan.learner, plan.provider(plan.learner))
    trainer.actor = create("actor", PolicyRole, c, spec, path, *learner)
    sharded = learner if plan.learner.shards_reference else ()  # the reference on the learner's sharding
    reference = c.model.reference_path or path  # OpenRLHF's --ref_pretrain; else the initial policy
    trainer.reference = create("reference", ReferenceRole, c, spec, reference,
                               *sharded) if plan.needs_reference else None
    trainer.critic = create("critic", CriticRole, c, spec, c.critic.path or path,
                            *learner) if plan.needs_critic else None
    trainer.reward = create("reward", RewardRole, c, spec, plan.rewards, plan.weights)
    getattr(trainer.placement, "ready", lambda: None)()  # a placement that starts roles concurrently
    trainer.env_runner = make_env_runner(c, trainer.pm, trainer.prompts.columns, trainer.tokenizer)
    if c.train.max_staleness:
        from .async_rollouts import LockedEngine

        trainer.engine = LockedEngine(trainer.engine, trainer.engine_lock)


def build_algorithm(trainer: Trainer) -> None:
    """The resolved estimator and KL estimator, the KL controller, the actor's and critic's
    objectives, reward shaping, the prompt sampler and the step's sampling parameters."""
    c, plan = trainer.config, trainer.plan
    trainer.estimator = resolve(plan.estimator.compute)
    trainer.kl_estimator = resolve(plan.kl.compute)
    trainer.kl_control = make_controller(c.algo.kl)
    trainer.entropy_control = make_entropy_coef(c.algo.policy_loss)
    trainer.objective = Objective(
        policy_loss=resolve(plan.policy_loss.compute),
        options=c.algo.policy_loss,
        kl_estimator=trainer.kl_estimator if trainer.reference is not None else None,
        norm_length=c.algo.policy_loss.norm_length,
        kl_ratio=c.algo.kl.ratio,
        kl_unbiased=c.algo.kl.unbiased_gradient,
    )
    trainer.value_objective = ValueObjective(c.critic.value_clip)
    trainer.shaper = RewardShaper(c.reward, c.generation.max_new_tokens)
    trainer.sampler = PromptSampler(len(trainer.prompts), c.train.seed, c.data.shuffle)
    trainer.sampling = SamplingParams(
        n=c.generation.n_samples_per_prompt,
        max_new_tokens=c.generation.max_new_tokens,
        temperature=c.generation.temperature,
        top_p=c.generation.top_p,
        top_k=c.generation.top_k,
        min_p=c.generation.min_p,
        repetition_penalty=c.generation.repetition_penalty,
        stop=tuple(c.generation.stop),
    )
