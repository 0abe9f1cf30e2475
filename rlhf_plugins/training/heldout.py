"""Held-out evaluation in a run: the evaluator of the run's own engine and reward role, evaluation
rows in ``metrics.jsonl``, and the best policy in ``best/``."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rich.console import Console

from ..data.prompts import PromptSet
from ..errors import DataError
from ..evaluation.evaluator import EvalSettings, Evaluator
from .reward_role import RewardBatch, RewardRole, reads_texts


def make_evaluator(config: Any, pm: Any, tokenizer: Any, engine: Any, reward: Any, prompts: PromptSet,
                   env_runner: Any = None) -> Evaluator:
    """``engine`` and ``reward`` are the run's generation and reward roles (local objects or Ray
    handles); with ``--eval.reward_functions`` those functions judge instead (their sum, in this
    process). Answers for maj@k come from the ``rlhf_extract_answer`` hook. With ``env_runner``
    (a multi-turn run) every sample is a trajectory in its environment, judged as in training."""
    if config.eval.reward_functions:
        names = list(config.eval.reward_functions)
        judge, with_texts = RewardRole(config, pm.spec, names, [1.0] * len(names)), reads_texts(pm, names)
    else:  # reward servers and OpenRLHF reward_func files see the prompt as the policy did (template included)
        judge, with_texts = reward, reads_texts(pm, list(config.reward.functions),
                                                   config.reward.remote_urls)
        if config.reward.weights and not any(config.reward.weights):  # e.g. a teacher's KL as the only reward
            logging.getLogger("rlhf_plugins").warning(
                "every reward source is weighted 0 (reward.weights), and the held-out evaluation judges with the "
                "run's reward: its pass@k will be 0; give --eval.reward_functions NAME to judge it")

    def score(index: list[int], samples: Any, texts: list[str], step: int, extra: dict[str, list[Any]]) -> list[float]:
        p = prompts
        prompt_ids = extra.pop("prompt_ids", None) or [p.prompt_ids[i] for i in index]
        columns = {**{k: [v[i] for i in index] for k, v in p.columns.items()}, **extra}
        batch = RewardBatch.of(tokenizer, [p.prompts[i] for i in index], prompt_ids, samples.completion_ids, texts,
                               columns, step, samples.finish_reasons, with_texts, evaluation=True)
        return judge.score(batch).scores

    def extract(text: str, row: dict[str, Any]) -> Any:
        return pm.decide("rlhf_extract_answer", completion=text, sample=row)

    sample = None
    if env_runner is not None:
        from ..environments import eval_sampler

        sample = eval_sampler(env_runner, engine, prompts)
    return Evaluator(prompts, tokenizer, engine, score, extract, EvalSettings.from_config(config), sample)


def improved(trainer: Any, metrics: dict[str, float]) -> bool:
    """Whether this evaluation is the best so far on ``--train.best_metric`` (and record it)."""
    t = trainer.config.train
    if not t.best_metric:
        return False
    if t.best_metric not in metrics:
        raise DataError(f"train.best_metric '{t.best_metric}' was not measured (maj@k needs a label column in the "
                        "held-out data); choose another metric")
    value = metrics[t.best_metric]
    old = trainer.best["value"] if trainer.best else None
    if old is not None and not (value > old if t.best_mode == "max" else value < old):
        return False
    trainer.best = {"metric": t.best_metric, "value": value, "step": trainer.step_count}
    return True


def run_eval(trainer: Any, run_dir: Path, log: Any, console: Console, progress: Any = None) -> dict[str, float]:
    """Evaluate the current policy, log it at the step it has reached (the updates it had), keep it
    in ``best/`` when it is the best so far, tell the observers."""
    from .state import write_json

    step = trainer.step_count
    metrics = {f"eval/{k}": v for k, v in trainer.evaluator(step, progress).items()}
    log.log(step, metrics)
    if trainer.config.eval.log_samples:
        log.rows("eval_samples.jsonl", trainer.evaluator.samples)
    trainer.eval_history.append({"step": step, **metrics})
    shown = "  ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items())
    console.print(f"eval after {step} steps ({len(trainer.evaluator)} prompts): {shown}", highlight=False,
                  soft_wrap=True)
    if improved(trainer, metrics):
        trainer.save_final(run_dir / "best", with_critic=False, averaged=False)  # the policy evaluated
        write_json(run_dir / "best.json", trainer.best)
    records = trainer.evaluator.samples if trainer.config.eval.log_samples else []
    trainer.pm.notify("rlhf_after_eval", step=step, metrics=metrics, samples=records)
    return metrics


def eval_due(config: Any, done: int) -> bool:
    """Evaluate after ``done`` steps: at the end, and every ``eval.every`` steps."""
    every = config.eval.every
    return done == config.train.steps or bool(every and done % every == 0)
