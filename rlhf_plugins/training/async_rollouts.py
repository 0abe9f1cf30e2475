"""Asynchronous RL: rollouts are generated ahead of the learner, within a bound on policy lag.

With ``train.max_staleness K >= 1`` a rollout worker (a thread of the driver; under Ray it drives
the engine actors while the learner actors train) generates and scores the rollouts of the next
steps while the learner trains on the current one. The bound is kept by *admission*: the rollout
of step ``t`` starts only once the learner has made ``t - K`` updates, and the worker brings the
engine to the newest weights before it starts, so every sample is trained on at most ``K``
versions after the policy that sampled it. Nothing finished is ever thrown away for being stale.

With ``generation.partial_rollout`` the worker generates in chunks and takes new weights between
them (:mod:`.policy_lag`).

The reference model's log-probs (they depend on the rollout alone) are computed in a thread of
their own, off the learner's path. A rollout is generated in ``generation.rollout_parts`` parts
(whole prompt groups, one engine call each) and the reference scores each part while the engine
generates the next, so only the last part's reference pass lies between admission and the learner.
Weight syncs run in the worker, between generation calls, under the learner's lock: the learner is
held only for the sync itself. Held-out evaluation shares the engine through the same engine lock.
Checkpoints record the prompt sampler at the next rollout the learner has not consumed; a resumed
run regenerates the queue from there with the restored policy (deterministic prompts and
seeds, but not the staler weights the interrupted run had used).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..protocols import Samples, SamplingParams
from .policy_lag import Stopped, staleness_metrics
from .rollout import Rollout, make_batch
from .rollout_sources import reads_rows, step_rollout


@dataclass
class Produced:
    """A rollout made ahead, and what the worker saw while making it."""

    step: int
    rollout: Any
    metrics: dict[str, float]
    #: the prompt sampler after this rollout's prompts: where a resumed run continues
    sampler_after: dict[str, Any]
    #: seconds the worker waited for admission before starting it
    engine_idle: float
    #: seconds of weight syncs done for it
    sync_seconds: float
    #: its tensors, with the reference log-probs (they depend on the rollout only), computed
    #: beside the next generation
    batch: Future


class LockedEngine:
    """The generation role, one caller at a time (the rollout worker, its syncs, evaluation)."""

    def __init__(self, engine: Any, lock: threading.RLock) -> None:
        self._engine, self._lock = engine, lock

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._engine, name)
        if not callable(value):
            return value

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return value(*args, **kwargs)

        return locked


class RolloutWorker:
    """Generates and scores rollouts ahead of the learner (see the module docstring)."""

    def __init__(self, trainer: Any, start: bool = True) -> None:
        self.trainer = trainer
        c = trainer.config
        self.k = c.train.max_staleness
        self.last_step = c.train.steps
        self.partial = c.generation.partial_rollout
        self.chunk = c.generation.partial_chunk_tokens
        self.parts = c.generation.rollout_parts
        self.cond = threading.Condition()
        self.queue: deque[Produced] = deque()
        self.learner_version = trainer.step_count
        self.next_step = trainer.step_count
        self.error: BaseException | None = None
        self.stopping = False
        self.sync_seconds = 0.0
        #: the worker waits for admission (its engine is free)
        self.idle = False
        #: the worker is about to sync new weights: the learner waits before its next update
        self.sync_due = False
        #: the learner set ``sync_due`` when it published (it is out of its update and will wait)
        self.promised = False
        #: the reference model scores one rollout while the engine generates the next
        self.finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlhf-reference")
        self.thread = threading.Thread(target=self._run, name="rlhf-rollouts", daemon=True)
        if start:
            self.thread.start()

    # --- the learner's side ---------------------------------------------------
    def take(self, step: int) -> Produced:
        """The rollout of ``step``, waiting for it if needed; an error of the worker is raised here."""
        with self.cond:
            while not self.queue and self.error is None:
                self.cond.wait()
            if self.error is not None:
                raise self.error
            item = self.queue.popleft()
            while self.sync_due and self.error is None:  # let the engine take the newest weights first
                self.cond.wait()
        assert item.step == step, f"rollout of step {item.step} arrived for step {step}"
        return item

    def queued(self) -> int:
        with self.cond:
            return len(self.queue)

    def published(self, version: int) -> None:
        """The learner has made ``version`` updates (called under the learner's lock, so the
        version is exactly the actor's weights): new weights to sync, maybe a rollout to admit.
        If the worker is waiting and may now start, it syncs before the learner's next update."""
        with self.cond:
            self.learner_version = version
            if self.idle and self._behind() and self._admitted(self.next_step):
                self.sync_due = self.promised = True
            self.cond.notify_all()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the generation call in progress (``timeout``: wait at most that long; the
        thread is a daemon, so an exiting process does not wait for it)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=timeout)
        self.finisher.shutdown(wait=timeout is None, cancel_futures=True)

    # --- the worker -------------------------------------------------------------
    def _behind(self) -> bool:
        return self.trainer.engine_version < self.learner_version

    def _admitted(self, step: int) -> bool:
        t = self.trainer
        if self.learner_version < step - self.k:  # the bound, whatever a plugin says
            return False
        answer = t.pm.decide("rlhf_admit_rollout", step=step, learner_version=self.learner_version,
                                              engine_version=t.engine_version, queued=[p.step for p in self.queue],
                                              max_staleness=self.k)
        return answer is not False

    def _run(self) -> None:
        t = self.trainer
        try:
            while True:
                step = self.next_step
                waited = time.perf_counter()
                with self.cond:
                    self.idle = True
                    while not self.stopping and step < self.last_step and not self._admitted(step):
                        if self.sync_due:  # a plugin changed its mind: nothing to sync before waiting
                            self.sync_due = self.promised = False
                            self.cond.notify_all()
                        self.cond.wait()
                    self.idle = False
                    if self.stopping or step >= self.last_step:
                        return
                waited = time.perf_counter() - waited
                self.sync_seconds = 0.0
                self.catch_up(required=step - self.k)
                t.reward_retries = 0
                rollout, metrics, batch = self._collect(step)
                item = Produced(step, rollout, metrics, dict(t.sampler.state_dict()), waited, self.sync_seconds, batch)
                with self.cond:
                    self.queue.append(item)
                    self.next_step = step + 1
                    if step + 1 < self.last_step and self._behind() and self._admitted(step + 1):
                        self.sync_due = True  # before the learner trains on this rollout
                    self.cond.notify_all()
        except Stopped:
            return
        except BaseException as exc:  # handed to the learner, which raises it in the main thread
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def _collect(self, step: int) -> tuple[Any, dict[str, float], Future]:
        """The rollout of ``step``, its metrics, and its batch to come (with reference log-probs).
        In parts (whole prompt groups, ``generation.rollout_parts``), the reference scores each part
        while the engine generates the next, so only the last part's reference pass is on the path
        from admission to the learner; scored as one rollout (shaping sees the whole batch)."""
        t = self.trainer
        parts = min(self.parts, t.config.train.prompts_per_step)
        if parts <= 1 or t.reference is None or t.config.reward.dynamic_filtering or reads_rows(t):
            rollout, metrics = t.collect(step)
            self._retries(metrics)
            return rollout, metrics, self.finisher.submit(self._finish, rollout, metrics, None)
        idx = t.sampler.take(t.config.train.prompts_per_step)
        pieces, refs = [], []
        for i in range(parts):
            piece = step_rollout(t, idx[i * len(idx) // parts:(i + 1) * len(idx) // parts], t.params_at(step, i))
            pieces.append(piece)
            refs.append(self.finisher.submit(self._reference, piece))
        rollout = t.score(step, Rollout.concat(pieces))
        metrics = t.drawn_metrics(rollout.raw_scores, rollout.metrics)
        self._retries(metrics)
        return rollout, metrics, self.finisher.submit(self._finish, rollout, metrics, refs)

    def _reference(self, piece: Any, batch: dict[str, Any] | None = None) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        batch = make_batch(piece, self.trainer.pad_id, **self.trainer.widths) if batch is None else batch
        return self.trainer.reference.logprobs(batch), time.perf_counter() - start

    def _retries(self, metrics: dict[str, float]) -> None:
        if self.trainer.config.reward.max_retries:
            metrics["reward/retries"] = float(self.trainer.reward_retries)

    def _finish(self, rollout: Any, metrics: dict[str, float], parts: list[Future] | None) -> dict[str, Any]:
        """The rollout's batch with its reference log-probs: computed here, or gathered from the
        parts' (each part's width padded to the batch's)."""
        t = self.trainer
        batch = make_batch(rollout, t.pad_id, **t.widths)
        if t.reference is not None:
            if parts is None:
                done = [self._reference(rollout, batch)]
            else:
                done = [f.result() for f in parts]
            width = batch["action_mask"].shape[1]
            batch["ref_logprobs"] = torch.cat([torch.nn.functional.pad(lp, (0, width - lp.shape[1])) for lp, _ in done])
            metrics["time/reference"] = sum(seconds for _, seconds in done)
        return batch

    def catch_up(self, required: int | None = None) -> None:
        """Bring the engine to the learner's newest weights, if it is behind. The sync needs the
        learner's lock (no update while weights are read): it waits for the lock only when the
        engine is older than ``required`` (the bound), else it syncs only if the learner is not
        in the middle of an update, and generation goes on with the weights it has."""
        t = self.trainer
        with self.cond:
            promised, self.promised = self.promised, False
            if not self._behind():
                self.sync_due = False
                self.cond.notify_all()
                return
            self.sync_due = True
        start = time.perf_counter()
        # wait for the lock when the bound needs these weights, or when the learner has promised to
        # wait for this sync (it only finishes publishing); else only take the lock if it is free
        must = promised or (required is not None and t.engine_version < required)
        got = t.learner_lock.acquire(blocking=must)
        try:
            if got:
                with t.engine_lock:  # sync methods may reach the engine's workers directly
                    with self.cond:
                        version = self.learner_version  # published under the learner's lock: exact
                    if t.engine_version < version:
                        t.sync_engine(version - 1)
                        self.sync_seconds += time.perf_counter() - start
        finally:
            if got:
                t.learner_lock.release()
            with self.cond:
                self.sync_due = False
                self.cond.notify_all()

    def sample(self, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[Samples, list[list[int]]]:
        """Partial rollouts: see :func:`.policy_lag.partial_sample`."""
        from .policy_lag import partial_sample

        return partial_sample(self, prompt_ids, params)


def async_step(trainer: Any, step: int) -> dict[str, float]:
    """One learner step of asynchronous training: take the rollout made ahead, learn, publish."""
    if trainer.worker is None:
        trainer.sampler_position = dict(trainer.sampler.state_dict())
        trainer.worker = RolloutWorker(trainer)
    worker = trainer.worker
    trainer.snapshot, trainer.phase = trainer.loop_state(), "rollout"
    t0 = time.perf_counter()
    item = worker.take(step)
    batch = item.batch.result()
    waited = time.perf_counter() - t0
    metrics = dict(item.metrics)
    metrics.update(staleness_metrics(step, item.rollout.versions))
    metrics.update({"async/learner_idle": waited, "async/engine_idle": item.engine_idle,
                    "async/queue": float(worker.queued()), "async/sync_seconds": item.sync_seconds})
    with trainer.learner_lock:
        metrics = trainer.learn(step, item.rollout, metrics, t0, sync=False, batch=batch)
        trainer.sampler_position = item.sampler_after
        worker.published(step + 1)
    return metrics
