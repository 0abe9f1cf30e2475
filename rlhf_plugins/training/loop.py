"""The training loop: one step = generate, score, forward, advantage, update, sync.

It calls only resolved components (plain functions and role objects) -- no branching on component
names -- and the same code drives local and Ray placements: roles are whatever the placement plugin returned.
"""
from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from .._lazy import resolve
from ..algorithms.advantages import AdvantageInputs
from ..algorithms.shaping import keep_groups, normalize_then_sum
from ..config.scale import warn_first_update
from ..config.schema import Config
from ..config.validate import Plan
from ..core.manager import RLHFPluginManager
from ..data.prompts import PromptSet
from ..protocols import SamplingParams
from ..sync import folder_tolerance, verify_parity
from .memory_watch import role_memory
from .reference_sync import refresh_reference
from .reward_role import RewardBatch, reads_texts
from .rollout import Rollout, batch_widths, make_batch, mask_truncated, rollout_metrics, step_timings
from .rollout_sources import step_rollout
from .samples import due_rows


class Trainer:
    def __init__(self, config: Config, pm: RLHFPluginManager, plan: Plan, prompts: PromptSet, tokenizer: Any,
                 model_path: str) -> None:
        self.config, self.pm, self.plan, self.prompts = config, pm, plan, prompts
        self.tokenizer, self.model_path = tokenizer, model_path
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.widths = batch_widths(config, plan)  # make_batch's width rounding (--learner.pad_to_multiple_of)
        #: steps done, the metrics of each, the rows of the last one's samples (train.log_samples_every)
        self.step_count, self.history, self.samples = 0, [], []
        self.placement: Any = None
        self.probe: dict[str, torch.Tensor] | None = None
        #: where the current step is: "rollout" until the first weight changes, then "update"
        self.phase = "idle"
        #: the loop state at the start of the current step (an exact checkpoint while in "rollout")
        self.snapshot: dict[str, Any] | None = None
        self.reward_retries = 0
        #: whether reward sources read the rendered texts (reward servers, OpenRLHF reward_func files)
        self.reads_texts = reads_texts(pm, list(config.reward.functions), config.reward.remote_urls)
        #: updates the engine's weights have had (the policy version it samples with)
        self.engine_version = 0
        #: held-out evaluation (attach_eval), and the best evaluation so far {"metric", "value", "step"}
        self.evaluator: Any = None
        self.eval_history: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        #: asynchronous training (train.max_staleness >= 1): the rollout worker, the sampler position
        #: of the next rollout the learner has not consumed, and the locks it shares with the learner
        self.worker: Any = None
        self.sampler_position: dict[str, Any] | None = None
        self.learner_lock, self.engine_lock = threading.RLock(), threading.RLock()
        #: multi-turn rollouts (--env.name or a data column naming environments)
        self.env_runner: Any = None

    def setup(self, resuming: bool = False) -> None:
        """Start every role, then the weight sync, then the algorithm's parts. An engine without weights, or
        behind the policy (a trained adapter), gets the learner's now, unless a checkpoint is loaded next."""
        from .setup import build_algorithm, create_roles

        create_roles(self)
        self.reset_sync()
        empty = self.plan.engine.starts_empty
        if not resuming and (self.plan.actor_moved or (empty is not None and resolve(empty)(self.config))):
            self.sync.sync(self.actor, self.engine, -1)
        build_algorithm(self)

    def reset_sync(self) -> None:
        """A fresh weight-sync object (at set-up, and after roles were restarted: it sets up anew)."""
        self.sync = resolve(self.plan.sync.factory)(self.config)
        self.sync_setup: dict[str, Any] = {}
        attach = getattr(self.sync, "attach", None)
        if callable(attach):
            self.sync_setup = dict(attach(self.actor, self.engine) or {})

    @property
    def needs_old_logprobs(self) -> bool:
        """Only when the policy moves before a sample is trained on (several updates per rollout),
        or when KL enters the reward (it needs the rollout-time policy)."""
        several_updates = self.config.updates_per_step() > 1
        return several_updates or (self.config.algo.kl.in_reward and self.reference is not None)

    # --- one step --------------------------------------------------------------
    def sample(self, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[Any, list[list[int]]]:
        """The engine's samples, and the policy version (updates the engine's weights had) of each
        sampled token. The asynchronous loop replaces it (partial rollouts swap weights mid-way)."""
        if self.worker is not None and self.worker.partial:
            return self.worker.sample(prompt_ids, params)
        samples = self.engine.generate(prompt_ids, params)
        return samples, [[self.engine_version] * len(c) for c in samples.completion_ids]

    def generate(self, step: int, round_: int = 0) -> Rollout:
        """Sample ``n`` completions for the next ``prompts_per_step`` prompts, and score them."""
        c = self.config
        idx = self.sampler.take(c.train.prompts_per_step)
        return self.score(step, step_rollout(self, idx, self.params_at(step, round_)))

    def params_at(self, step: int, round_: int = 0) -> SamplingParams:
        """The sampling parameters of a step's ``round_``-th generation call (its seed)."""
        return dataclasses.replace(self.sampling, seed=self.config.train.seed * 1_000_003 + step * 101 + round_)

    def score(self, step: int, rollout: Rollout) -> Rollout:
        """Score a rollout in place: reward functions or models, then shaping."""
        c = self.config
        result = self.reward.score(RewardBatch.of(self.tokenizer, rollout.prompts, rollout.prompt_ids,
                                                  rollout.completion_ids, rollout.completions, rollout.columns, step,
                                                  rollout.finish_reasons, self.reads_texts,
                                                  epoch=self.sampler.passes(before=len(rollout) // rollout.group_size)))
        rollout.raw_scores, rollout.reward_components, rollout.extra = result.scores, result.parts, result.extra
        rollout.filter_scores = result.filter_scores or []
        rollout.metrics.update({name: sum(v) / len(v) for name, v in result.logged.items() if v})  # TRL's log_metric
        self.reward_retries += result.retries
        combined = rollout.raw_scores if c.reward.combine == "sum" else normalize_then_sum(
            result.parts, c.reward.weights, rollout.group_size)
        rollout.scores = self.shaper(combined, [len(x) for x in rollout.completion_ids], rollout.finish_reasons)
        return rollout

    def collect(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """One rollout; with dynamic filtering, only groups with signal, refilled from further prompts."""
        c = self.config
        rollout = self.generate(step)
        raw, measured = list(rollout.raw_scores), rollout.metrics
        if not c.reward.dynamic_filtering:
            return rollout, self.drawn_metrics(raw, measured)
        want, kept, n_kept, rounds = c.train.prompts_per_step, [], 0, 1
        while True:
            groups = keep_groups(rollout.filter_scores or rollout.scores, rollout.group_size, c.reward.filter_range)
            if groups:
                kept.append(rollout.select_groups(groups))
                n_kept += len(groups)
            if n_kept >= want or rounds >= c.reward.filter_max_rounds:
                break
            rollout = self.generate(step, rounds)
            raw += rollout.raw_scores
            rounds += 1
        metrics = {**self.drawn_metrics(raw, measured), "filter/rounds": rounds,
                   "filter/kept_groups": min(n_kept, want) / want}
        if not kept:
            return rollout, metrics  # nothing had signal: the update is a no-op for group estimators
        return Rollout.concat(kept).select_groups(range(min(n_kept, want))), metrics

    def drawn_metrics(self, raw: list[float], measured: dict[str, float]) -> dict[str, float]:
        """A rollout's mean reward, what its reward functions logged and the passes over the prompts so far."""
        return {"reward/mean": statistics.fmean(raw or [0.0]), "epoch": self.sampler.passes(), **measured}

    def step(self, step: int) -> dict[str, float]:
        """One step: generate and score, learn, sync the engine (asynchronous training: learn on
        a rollout generated ahead, see async_rollouts)."""
        if self.config.train.max_staleness:
            from .async_rollouts import async_step

            return async_step(self, step)
        self.snapshot, self.phase, self.reward_retries = self.loop_state(), "rollout", 0
        t0 = time.perf_counter()
        rollout, metrics = self.collect(step)
        return self.learn(step, rollout, metrics, t0, sync=True)

    def learn(self, step: int, rollout: Rollout, metrics: dict[str, float], t0: float, sync: bool,
              batch: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """Everything after the rollout: advantages, the update, and (``sync``) the weight sync.
        ``t0``: when the step began (its generation, or its wait for a rollout); ``batch``: the
        rollout's tensors when made ahead (with the reference log-probs, off the learner's path)."""
        c = self.config
        t_gen = time.perf_counter()
        self.pm.notify("rlhf_after_rollout", step=step, rollout=rollout)
        batch = make_batch(rollout, self.pad_id, **self.widths) if batch is None else batch
        timings = self.forward_passes(batch)
        kl_coef = self.kl_control.value
        kl_penalty = self.advantages(batch, rollout, kl_coef)
        shown = mask_truncated(batch, rollout) if c.algo.policy_loss.mask_truncated else batch
        t_prep = time.perf_counter()
        objective = dataclasses.replace(self.objective, kl_coef=0.0 if c.algo.kl.in_reward else kl_coef,
                                        entropy_coef=self.entropy_control.value)
        self.phase = "update"
        batch["balance_tokens"] = bool(c.learner.max_tokens_per_micro_batch)  # shards of equal tokens per rank
        if step >= c.critic.freezing_steps:  # the critic's warm-up: the actor waits
            metrics.update(self.actor.train(batch, objective))
        if self.critic is not None:
            metrics.update(self.critic.train(batch, self.value_objective))
        metrics.update(self.entropy_control.update(metrics))
        metrics.update(refresh_reference(self, step))  # every algo.kl.ref_sync_steps: towards the policy
        t_train = time.perf_counter()
        if self.probe is None:
            self.probe = {k: shown[k][:8] for k in ("sequences", "attention_mask", "action_mask")}
        if sync:
            self.sync_engine(step)
        t_end = time.perf_counter()
        metrics.update(rollout_metrics(rollout, shown, kl_penalty, self.kl_control.value))
        self.samples = due_rows(c.train.log_samples_every, step, rollout, batch)
        if self.reference is not None:
            measured = metrics.get("kl", metrics.get("kl/rollout", 0.0))
            self.kl_control.update(measured, len(rollout))
            metrics["kl/coef"] = kl_coef
            if step == 1:  # this step's policy has had exactly one update
                warn_first_update(measured, c)
        metrics.update(step_timings(shown, timings, t0, t_gen, t_prep, t_train, t_end))
        metrics.update(role_memory({"generation": self.engine, "actor": self.actor, "reference": self.reference,
                                    "critic": self.critic, "reward": self.reward}))
        if c.reward.max_retries:
            metrics.setdefault("reward/retries", float(self.reward_retries))
        self.step_count = step + 1
        self.phase = "idle"
        self.history.append(metrics)
        return metrics

    def forward_passes(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """The rollout-time log-probs, reference log-probs and values the batch still lacks; their seconds."""
        timings: dict[str, float] = {}
        for key, role, method in (("old_logprobs", self.actor if self.needs_old_logprobs else None, "logprobs"),
                                  ("ref_logprobs", self.reference, "logprobs"), ("values", self.critic, "values")):
            if role is not None and key not in batch:
                start = time.perf_counter()
                batch[key] = getattr(role, method)(batch)
                timings[key] = time.perf_counter() - start
        return timings

    def advantages(self, batch: dict[str, torch.Tensor], rollout: Rollout, kl_coef: float) -> torch.Tensor | None:
        """Advantages and returns into ``batch``; returns the per-token KL penalty (KL in the reward)."""
        c, a = self.config, self.config.algo.advantage
        kl_penalty = None
        if c.algo.kl.in_reward and self.reference is not None:
            kl_penalty = kl_coef * self.kl_estimator(batch["old_logprobs"], batch["ref_logprobs"])
        batch["advantages"], batch["returns"] = self.estimator(AdvantageInputs(
            scores=batch["scores"], action_mask=batch["action_mask"], group_size=rollout.group_size, gamma=a.gamma,
            lam=a.lam, values=batch.get("values"), kl_penalty=kl_penalty, kl_in_baseline=c.algo.kl.penalty_in_baseline,
            std_norm=a.std_norm, std_eps=a.std_eps, normalize=a.normalize_advantages, scored=rollout.scored()))
        return kl_penalty

    def sync_engine(self, step: int) -> None:
        """Bring the engine to the learner's weights (``step + 1`` updates)."""
        c = self.config
        start = time.perf_counter()
        sync_info = dict(self.sync.sync(self.actor, self.engine, step) or {})
        sync_info.setdefault("method", c.sync.method)
        sync_info["seconds"] = time.perf_counter() - start
        if self.sync_setup:  # the first sync after attach() reports what attach did
            sync_info["setup"], self.sync_setup = self.sync_setup, {}
        self.engine_version = step + 1
        if c.sync.verify:
            tol = folder_tolerance(self.model_path, c.model.trust_remote_code)
            sync_info["parity_max_abs_diff"] = verify_parity(self.actor, self.engine, self.probe, tol)
        self.pm.notify("rlhf_after_weight_sync", step=step, info=sync_info)

    # --- state ----------------------------------------------------------------
    def loop_state(self) -> dict[str, Any]:
        """What the loop itself carries from step to step, as plain data."""
        from .state import loop_state

        return loop_state(self)

    def save_checkpoint(self, run_dir: Path, keep: int, snapshot: dict[str, Any] | None = None) -> Path:
        """A complete checkpoint of the steps done so far (``snapshot``: the loop state to record
        instead of the current one, when a step failed before changing any weights)."""
        from .state import save_checkpoint

        return save_checkpoint(self, run_dir, keep, snapshot)

    def load_checkpoint(self, path: Path) -> int:
        """Restore every role and the loop from a checkpoint folder; returns the steps done."""
        from .state import load_checkpoint

        return load_checkpoint(self, path)

    def save_final(self, out: Path, with_critic: bool = True, averaged: bool = True) -> None:
        """The policy (``averaged``: its weights' moving average under --learner.ema) and the critic, in
        ``critic/`` beside it, as ``save_pretrained`` folders."""
        from .state import save_final

        save_final(self, out, with_critic, averaged)

    def summary(self) -> dict[str, Any]:
        """First-10% vs last-10% mean reward, seconds per step, evaluations and memory of the run."""
        from .state import summary

        return summary(self)

    def stop_worker(self, timeout: float | None = None) -> None:
        """Stop generating ahead (before a checkpoint is loaded, and at the end); the queue is dropped."""
        if self.worker is not None:
            self.worker.stop(timeout)
            self.worker, self.sampler_position = None, None

    def shutdown(self) -> None:
        self.stop_worker(timeout=30.0)  # at the end of a run: do not wait out a long generation
        if self.env_runner is not None:
            self.env_runner.close()
        if self.placement is not None:
            self.placement.shutdown()

