"""The training loop: one step = generate, score, forward, advantage, update, sync.

It calls only resolved components (plain functions and role objects) -- no
branching on component names -- and the same code drives local and Ray
placements: roles are whatever the placement plugin returned.
"""
from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from ._lazy import resolve
from .algorithms.advantages import AdvantageInputs
from .algorithms.numerics import masked_mean
from .algorithms.objective import Objective
from .config import Config
from .data import PromptSampler, PromptSet
from .engines import SamplingParams
from .manager import RLHFPluginManager
from .roles import GenerationRole, PolicyRole, ReferenceRole, RewardRole
from .rollout import Rollout, make_batch
from .sync import verify_parity
from .types import AdvantageEstimator, KLEstimator, PlacementStrategy, PolicyLoss, WeightSyncMethod
from .validate import Plan


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


class Trainer:
    def __init__(
        self,
        config: Config,
        pm: RLHFPluginManager,
        plan: Plan,
        prompts: PromptSet,
        tokenizer: Any,
        model_path: str,
    ) -> None:
        self.config = config
        self.pm = pm
        self.plan = plan
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.step_count = 0
        self.history: list[dict[str, float]] = []
        self.placement: Any = None
        self.probe: dict[str, torch.Tensor] | None = None

    # --- set-up --------------------------------------------------------------
    def setup(self) -> None:
        c, reg, spec = self.config, self.pm.components, self.pm.spec
        if c.train.num_threads:
            torch.set_num_threads(c.train.num_threads)
        seed_everything(c.train.seed)
        self.placement = resolve(reg.get(PlacementStrategy, c.placement.strategy).factory)(c, spec)
        create = self.placement.create_role
        self.engine = create("generation", GenerationRole, c, spec, self.model_path)
        self.actor = create("actor", PolicyRole, c, spec, self.model_path)
        self.reference = create("reference", ReferenceRole, c, spec, self.model_path) if self.plan.needs_reference else None
        self.reward = create("reward", RewardRole, c, spec, self.plan.rewards, self.plan.weights)
        self.sync = resolve(reg.get(WeightSyncMethod, c.sync.method).factory)(c)
        self.estimator = resolve(reg.get(AdvantageEstimator, c.algo.advantage.estimator).compute)
        self.kl_estimator = resolve(reg.get(KLEstimator, c.algo.kl.estimator).compute)
        kl = c.algo.kl
        self.objective = Objective(
            policy_loss=resolve(reg.get(PolicyLoss, c.algo.policy_loss.name).compute),
            options=c.algo.policy_loss,
            kl_estimator=self.kl_estimator if self.reference is not None else None,
            kl_coef=0.0 if kl.in_reward else kl.coef,
        )
        self.sampler = PromptSampler(len(self.prompts), c.train.seed, c.data.shuffle)
        self.sampling = SamplingParams(
            n=c.generation.n_samples_per_prompt,
            max_new_tokens=c.generation.max_new_tokens,
            temperature=c.generation.temperature,
            top_p=c.generation.top_p,
            top_k=c.generation.top_k,
        )

    @property
    def needs_old_logprobs(self) -> bool:
        """Only when the policy moves before a sample is trained on (several updates per rollout)."""
        l = self.config.learner
        batch = self.config.train.prompts_per_step * self.config.generation.n_samples_per_prompt
        several_updates = l.epochs > 1 or (0 < l.mini_batch_size < batch)
        return several_updates or (self.config.algo.kl.in_reward and self.reference is not None)

    # --- one step --------------------------------------------------------------
    def generate(self, step: int) -> Rollout:
        c = self.config
        idx = self.sampler.take(c.train.prompts_per_step)
        params = dataclasses.replace(self.sampling, seed=c.train.seed * 1_000_003 + step)
        samples = self.engine.generate([self.prompts.prompt_ids[i] for i in idx], params)
        per_sample = [idx[j] for j in samples.prompt_index]
        return Rollout(
            prompts=[self.prompts.prompts[i] for i in per_sample],
            prompt_ids=[self.prompts.prompt_ids[i] for i in per_sample],
            completion_ids=samples.completion_ids,
            completions=self.tokenizer.batch_decode(samples.completion_ids, skip_special_tokens=True),
            finish_reasons=samples.finish_reasons,
            rollout_logprobs=samples.logprobs,
            columns={k: [v[i] for i in per_sample] for k, v in self.prompts.columns.items()},
            group_size=c.generation.n_samples_per_prompt,
        )

    def step(self, step: int) -> dict[str, float]:
        c = self.config
        t0 = time.perf_counter()
        rollout = self.generate(step)
        t_gen = time.perf_counter()
        rollout.scores, rollout.reward_components = self.reward.score(
            rollout.prompts, rollout.completions, rollout.completion_ids, rollout.columns, step
        )
        self.pm.notify("rlhf_after_rollout", step=step, rollout=rollout)
        batch = make_batch(rollout, self.pad_id)
        if self.needs_old_logprobs:
            batch["old_logprobs"] = self.actor.logprobs(batch)
        if self.reference is not None:
            batch["ref_logprobs"] = self.reference.logprobs(batch)
        kl_penalty = None
        if c.algo.kl.in_reward and self.reference is not None:
            kl_penalty = c.algo.kl.coef * self.kl_estimator(batch["old_logprobs"], batch["ref_logprobs"])
        advantages, returns = self.estimator(
            AdvantageInputs(
                scores=batch["scores"],
                action_mask=batch["action_mask"],
                group_size=rollout.group_size,
                gamma=c.algo.advantage.gamma,
                lam=c.algo.advantage.lam,
                kl_penalty=kl_penalty,
            )
        )
        batch["advantages"], batch["returns"] = advantages, returns
        t_prep = time.perf_counter()
        metrics = dict(self.actor.train(batch, self.objective))
        t_train = time.perf_counter()
        sync_info = self.sync.sync(self.actor, self.engine, step)
        if c.sync.verify:
            if self.probe is None:
                self.probe = {k: batch[k][:8] for k in ("sequences", "attention_mask", "action_mask")}
            sync_info["parity_max_abs_diff"] = verify_parity(self.actor, self.engine, self.probe)
        self.pm.notify("rlhf_after_weight_sync", step=step, info=sync_info)
        t_end = time.perf_counter()
        metrics.update(self._rollout_metrics(rollout, batch))
        tokens = float(batch["action_mask"].sum())
        metrics.update({
            "time/generate": t_gen - t0,
            "time/prepare": t_prep - t_gen,
            "time/train": t_train - t_prep,
            "time/sync": t_end - t_train,
            "time/step": t_end - t0,
            "throughput/generated_tokens_per_s": tokens / max(t_gen - t0, 1e-9),
        })
        self.step_count = step + 1
        self.history.append(metrics)
        return metrics

    def _rollout_metrics(self, rollout: Rollout, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        scores = batch["scores"]
        out = {
            "reward/mean": float(scores.mean()),
            "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
            "completion/length": float(batch["action_mask"].sum(-1).mean()),
            "completion/stopped": sum(r == "stop" for r in rollout.finish_reasons) / len(rollout),
            "advantage/mean": float(masked_mean(batch["advantages"], batch["action_mask"])),
        }
        for name, values in rollout.reward_components.items():
            vals = [v for v in values if v is not None]
            if vals and len(rollout.reward_components) > 1:
                out[f"reward/{name}"] = sum(vals) / len(vals)
        if "ref_logprobs" in batch and "kl" not in out:
            lp = batch.get("old_logprobs")
            if lp is not None:
                out["kl/rollout"] = float(masked_mean(self.kl_estimator(lp, batch["ref_logprobs"]), batch["action_mask"]))
        return out

    # --- state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "sampler": self.sampler.state_dict(),
            "actor": self.actor.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.actor.load_state_dict(state["actor"])
        torch.set_rng_state(state["torch_rng"])
        self.sync.sync(self.actor, self.engine, self.step_count)

    def save_final(self, out: Path) -> None:
        self.actor.save(str(out))
        self.tokenizer.save_pretrained(str(out))

    def summary(self) -> dict[str, float]:
        rewards = [m["reward/mean"] for m in self.history]
        k = max(1, len(rewards) // 10)
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        times = [m["time/step"] for m in self.history]
        return {
            "steps": len(rewards),
            "reward_first_10pct": first,
            "reward_last_10pct": last,
            "reward_gain": last - first,
            "seconds_per_step": sum(times) / max(len(times), 1),
        }

    def shutdown(self) -> None:
        if self.placement is not None:
            self.placement.shutdown()


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
