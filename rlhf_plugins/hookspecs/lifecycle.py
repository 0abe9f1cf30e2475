"""Lifecycle hooks: observers of a run.

All are collecting and return ``None``. An observer must not break the run: an
implementation that raises becomes a warning naming its plugin, and the other
observers still run. They are called through pluggy, so a new-style wrapper
(``@hookimpl(wrapper=True)``) sees every call (and its exceptions are its own). ``rlhf_on_error``
tells every observer, then the error is re-raised.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._markers import hookspec

if TYPE_CHECKING:
    from ..config.schema import Config
    from ..training.rollout import Rollout


@hookspec
def rlhf_before_train(config: Config, run_dir: Path) -> None:
    """Called once, after every role is placed and loaded, before the first step.

    ``run_dir`` already holds ``config.yaml``. Example::

        @hookimpl
        def rlhf_before_train(config, run_dir):
            print("training", config.model.path, "into", run_dir)
    """


@hookspec
def rlhf_after_rollout(step: int, rollout: Rollout) -> None:
    """Called every step after generation and scoring, before advantages.

    ``rollout`` holds the prompts, completions (text and token ids), scores per
    reward function and the combined score. Read it; do not modify it. Example::

        @hookimpl
        def rlhf_after_rollout(step, rollout):
            if step % 10 == 0:
                print(rollout.completions[0])
    """


@hookspec
def rlhf_after_step(step: int, metrics: Mapping[str, float]) -> None:
    """Called every step after the optimizer step and weight sync, with the
    step's metrics (``reward/mean``, ``loss/policy``, ``kl``, ``time/step`` ...).
    Example::

        @hookimpl
        def rlhf_after_step(step, metrics):
            wandb.log(dict(metrics), step=step)
    """


@hookspec
def rlhf_after_samples(step: int, samples: list[dict[str, Any]]) -> None:
    """Called on the steps ``train.log_samples_every`` picks, after ``rlhf_after_step``, with the rows
    ``samples.jsonl`` gets: per sample ``prompt``, ``completion``, ``rewards`` (each source's score),
    ``reward``, ``advantage``, ``tokens``, ``finish_reason``, ``group``, ``columns`` (and ``extra``, TRL's
    ``log_extra`` columns). The builtin trackers log them as a table. Example::

        @hookimpl
        def rlhf_after_samples(step, samples):
            best = max(samples, key=lambda s: s["reward"] or 0.0)
            print(step, best["completion"])
    """


@hookspec
def rlhf_after_eval(step: int, metrics: Mapping[str, float], samples: list[dict[str, Any]]) -> None:
    """Called after each held-out evaluation with its metrics (``eval/pass@1``, ``eval/pass@8``,
    ``eval/mean@8``, ``eval/maj@8``, ``eval/greedy``); ``step`` is the number of updates the
    evaluated policy has had (0: before training). ``samples``: with ``--eval.log_samples`` the records
    ``eval_samples.jsonl`` gets, a row per prompt (``prompt``, ``columns``, ``samples`` -- each with its
    ``completion``, ``score``, ``answer`` and whether it was ``correct`` -- and ``greedy``); else empty. The builtin
    trackers log them as a table. An implementation may leave ``samples`` out of its signature. Example::

        @hookimpl
        def rlhf_after_eval(step, metrics):
            print(f"after {step} updates: pass@1 {metrics['eval/pass@1']:.2f}")
    """


@hookspec
def rlhf_after_weight_sync(step: int, info: Mapping[str, Any]) -> None:
    """Called after new weights reached the generation engine. ``info`` says
    what moved (``method``, ``tensors``, ``bytes``, ``rpcs``, ``seconds``). Example::

        @hookimpl
        def rlhf_after_weight_sync(step, info):
            assert info["tensors"] > 0
    """


@hookspec
def rlhf_on_error(step: int | None, error: BaseException) -> None:
    """Called when the run fails, before the error propagates. ``step`` is the
    step that failed (``None`` before the first). Example::

        @hookimpl
        def rlhf_on_error(step, error):
            alert(f"run failed at step {step}: {error}")
    """


@hookspec
def rlhf_after_train(run_dir: Path, metrics: Mapping[str, float]) -> None:
    """Called once after the final policy is saved, with the run's summary
    metrics. Example::

        @hookimpl
        def rlhf_after_train(run_dir, metrics):
            upload(run_dir / "final")
    """
