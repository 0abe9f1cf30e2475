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
from .algorithms.kl_control import make_controller
from .algorithms.numerics import masked_mean
from .algorithms.objective import Objective
from .algorithms.value import ValueObjective
from .config import Config
from .data import PromptSampler, PromptSet
from .engines import SamplingParams
from .manager import RLHFPluginManager
from .roles import CriticRole, GenerationRole, PolicyRole, ReferenceRole, RewardRole
from .rollout import Rollout, make_batch
from .shaping import RewardShaper, keep_groups
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
        roles = ["generation", "actor"] + ["reference"] * self.plan.needs_reference
        roles += ["critic"] * self.plan.needs_critic + ["reward"]
        self.placement = resolve(reg.get(PlacementStrategy, c.placement.strategy).factory)(c, spec, roles=tuple(roles))
        create = self.placement.create_role
        self.engine = create("generation", GenerationRole, c, spec, self.model_path)
        self.actor = create("actor", PolicyRole, c, spec, self.model_path)
        self.reference = create("reference", ReferenceRole, c, spec, self.model_path) if self.plan.needs_reference else None
        self.critic = (
            create("critic", CriticRole, c, spec, c.critic.path or self.model_path) if self.plan.needs_critic else None
        )
        self.reward = create("reward", RewardRole, c, spec, self.plan.rewards, self.plan.weights)
        self.sync = resolve(reg.get(WeightSyncMethod, c.sync.method).factory)(c)
        self.estimator = resolve(reg.get(AdvantageEstimator, c.algo.advantage.estimator).compute)
        self.kl_estimator = resolve(reg.get(KLEstimator, c.algo.kl.estimator).compute)
        self.kl_control = make_controller(c.algo.kl)
        self.objective = Objective(
            policy_loss=resolve(reg.get(PolicyLoss, c.algo.policy_loss.name).compute),
            options=c.algo.policy_loss,
            kl_estimator=self.kl_estimator if self.reference is not None else None,
        )
        self.value_objective = ValueObjective(c.critic.value_clip)
        self.shaper = RewardShaper(c.reward, c.generation.max_new_tokens)
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
        """Only when the policy moves before a sample is trained on (several updates per rollout),
        or when KL enters the reward (it needs the rollout-time policy)."""
        l = self.config.learner
        batch = self.config.train.prompts_per_step * self.config.generation.n_samples_per_prompt
        several_updates = l.epochs > 1 or (0 < l.mini_batch_size < batch)
        return several_updates or (self.config.algo.kl.in_reward and self.reference is not None)

    # --- one step --------------------------------------------------------------
    def generate(self, step: int, round_: int = 0) -> Rollout:
        """Sample ``n`` completions for the next ``prompts_per_step`` prompts, and score them."""
        c = self.config
        idx = self.sampler.take(c.train.prompts_per_step)
        params = dataclasses.replace(self.sampling, seed=c.train.seed * 1_000_003 + step * 101 + round_)
        samples = self.engine.generate([self.prompts.prompt_ids[i] for i in idx], params)
        per_sample = [idx[j] for j in samples.prompt_index]
        rollout = Rollout(
            prompts=[self.prompts.prompts[i] for i in per_sample],
            prompt_ids=[self.prompts.prompt_ids[i] for i in per_sample],
            completion_ids=samples.completion_ids,
            completions=self.tokenizer.batch_decode(samples.completion_ids, skip_special_tokens=True),
            finish_reasons=samples.finish_reasons,
            rollout_logprobs=samples.logprobs,
            columns={k: [v[i] for i in per_sample] for k, v in self.prompts.columns.items()},
            group_size=c.generation.n_samples_per_prompt,
        )
        rollout.raw_scores, rollout.reward_components = self.reward.score(
            rollout.prompts, rollout.completions, rollout.completion_ids, rollout.columns, step
        )
        rollout.scores = self.shaper(
            rollout.raw_scores, [len(x) for x in rollout.completion_ids], rollout.finish_reasons
        )
        return rollout

    def collect(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """One rollout; with dynamic filtering, only groups with signal, refilled from further prompts."""
        c = self.config
        rollout = self.generate(step)
        raw = list(rollout.raw_scores)
        if not c.reward.dynamic_filtering:
            return rollout, {"reward/mean": _mean(raw)}
        want, kept, n_kept, rounds = c.train.prompts_per_step, [], 0, 1
        while True:
            groups = keep_groups(rollout.scores, rollout.group_size, c.reward.filter_range)
            if groups:
                kept.append(rollout.select_groups(groups))
                n_kept += len(groups)
            if n_kept >= want or rounds >= c.reward.filter_max_rounds:
                break
            rollout = self.generate(step, rounds)
            raw += rollout.raw_scores
            rounds += 1
        metrics = {"reward/mean": _mean(raw), "filter/rounds": rounds, "filter/kept_groups": min(n_kept, want) / want}
        if not kept:
            return rollout, metrics  # nothing had signal: the update is a no-op for group estimators
        return Rollout.concat(kept).select_groups(range(min(n_kept, want))), metrics

    def step(self, step: int) -> dict[str, float]:
        c = self.config
        t0 = time.perf_counter()
        rollout, metrics = self.collect(step)
        t_gen = time.perf_counter()
        self.pm.notify("rlhf_after_rollout", step=step, rollout=rollout)
        batch = make_batch(rollout, self.pad_id)
        if self.needs_old_logprobs:
            batch["old_logprobs"] = self.actor.logprobs(batch)
        if self.reference is not None:
            batch["ref_logprobs"] = self.reference.logprobs(batch)
        if self.critic is not None:
            batch["values"] = self.critic.values(batch)
        kl_coef = self.kl_control.value
        kl_penalty = None
        if c.algo.kl.in_reward and self.reference is not None:
            kl_penalty = kl_coef * self.kl_estimator(batch["old_logprobs"], batch["ref_logprobs"])
        advantages, returns = self.estimator(
            AdvantageInputs(
                scores=batch["scores"],
                action_mask=batch["action_mask"],
                group_size=rollout.group_size,
                gamma=c.algo.advantage.gamma,
                lam=c.algo.advantage.lam,
                values=batch.get("values"),
                kl_penalty=kl_penalty,
            )
        )
        batch["advantages"], batch["returns"] = advantages, returns
        t_prep = time.perf_counter()
        objective = dataclasses.replace(self.objective, kl_coef=0.0 if c.algo.kl.in_reward else kl_coef)
        metrics.update(self.actor.train(batch, objective))
        if self.critic is not None:
            metrics.update(self.critic.train(batch, self.value_objective))
        t_train = time.perf_counter()
        sync_info = self.sync.sync(self.actor, self.engine, step)
        if c.sync.verify:
            if self.probe is None:
                self.probe = {k: batch[k][:8] for k in ("sequences", "attention_mask", "action_mask")}
            sync_info["parity_max_abs_diff"] = verify_parity(self.actor, self.engine, self.probe)
        self.pm.notify("rlhf_after_weight_sync", step=step, info=sync_info)
        t_end = time.perf_counter()
        metrics.update(self._rollout_metrics(rollout, batch, kl_penalty))
        if self.reference is not None:
            measured = metrics.get("kl", metrics.get("kl/rollout", 0.0))
            self.kl_control.update(measured, len(rollout))
            metrics["kl/coef"] = kl_coef
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

    def _rollout_metrics(
        self, rollout: Rollout, batch: dict[str, torch.Tensor], kl_penalty: torch.Tensor | None
    ) -> dict[str, float]:
        mask = batch["action_mask"]
        scores = batch["scores"]
        out = {
            "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
            "completion/length": float(mask.sum(-1).mean()),
            "completion/stopped": sum(r == "stop" for r in rollout.finish_reasons) / len(rollout),
            "advantage/mean": float(masked_mean(batch["advantages"], mask)),
        }
        if rollout.scores != rollout.raw_scores:
            out["reward/shaped_mean"] = float(scores.mean())
        if len(rollout.reward_components) > 1:
            for name, values in rollout.reward_components.items():
                vals = [v for v in values if v is not None]
                if vals:
                    out[f"reward/{name}"] = sum(vals) / len(vals)
        if kl_penalty is not None:
            out["kl/rollout"] = float(masked_mean(kl_penalty, mask)) / max(self.kl_control.value, 1e-12)
        return out

    # --- state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {
            "step": self.step_count,
            "sampler": self.sampler.state_dict(),
            "actor": self.actor.state_dict(),
            "kl_controller": self.kl_control.state_dict(),
            "reward_shaper": self.shaper.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.actor.load_state_dict(state["actor"])
        self.kl_control.load_state_dict(state["kl_controller"])
        self.shaper.load_state_dict(state["reward_shaper"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        torch.set_rng_state(state["torch_rng"])
        self.sync.sync(self.actor, self.engine, self.step_count)

    def save_final(self, out: Path) -> None:
        out = out.resolve()  # roles may run in processes with another working directory
        self.actor.save(str(out))
        self.tokenizer.save_pretrained(str(out))
        if self.critic is not None:
            self.critic.save(str(out.parent / "critic"))

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


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
