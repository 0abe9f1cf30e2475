"""Held-out evaluation through a run's own generation engine.

For every held-out prompt: ``n`` samples at the evaluation temperature and one greedy sample,
scored by the reward (the training reward, or ``--eval.reward_functions``); a sample is correct
when its score reaches ``--eval.threshold``. Reported as ``pass@1``, ``pass@n`` (the unbiased
estimator), ``mean@n``, ``maj@n`` (majority vote over answers extracted by the
``rlhf_extract_answer`` hook, against the label) and ``greedy``.

The engine may be local or a Ray role, vLLM or transformers: the evaluator only calls
``generate`` and the scorer it is given, so evaluation in the loop, ``rlhf eval`` and the
stages share it (:mod:`rlhf_plugins.training.heldout` builds the one of a run).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..backend_data import derived_seed
from ..data.prompts import PromptSet
from ..protocols import Samples, SamplingParams
from ..tables import PLAIN
from .metrics import summarise

#: (prompt index of each sample, the samples, their decoded texts, the step, extra per-sample
#: columns) -> one score per sample
Scorer = Callable[[list[int], Samples, list[str], int, dict[str, list[Any]]], list[float]]
#: (prompt indices, sampling params) -> (samples, the texts to judge, extra per-sample columns):
#: how a multi-turn run samples (the trajectories, judged on their last model turn)
Sampler = Callable[[list[int], SamplingParams], tuple[Samples, list[str], dict[str, list[Any]]]]
Extractor = Callable[[str, dict[str, Any]], Any]  # (completion, the prompt's row) -> answer or None


@dataclass
class EvalSettings:
    n_samples: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 8
    threshold: float = 1.0
    batch_prompts: int = 64
    seed: int = 0
    #: the training rollouts' stop strings (generation.stop)
    stop: tuple[str, ...] = ()
    #: keep a record of each prompt's samples (eval.log_samples)
    keep_samples: bool = False

    @classmethod
    def from_config(cls, config: Any) -> EvalSettings:
        e = config.eval
        return cls(e.n_samples, e.temperature, e.max_new_tokens or config.generation.max_new_tokens, e.threshold,
                   e.batch_prompts, config.train.seed, tuple(config.generation.stop), e.log_samples)


class Evaluator:
    """``evaluator(step)`` -> ``{"pass@1": ..., "pass@8": ..., ...}`` for the policy the engine holds; after
    it, with ``keep_samples``, ``samples`` holds a record per held-out prompt (its samples, their scores and
    answers)."""

    def __init__(self, prompts: PromptSet, tokenizer: Any, engine: Any, score: Scorer, extract: Extractor,
                 settings: EvalSettings, sample: Sampler | None = None) -> None:
        self.sample = sample
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.engine = engine
        self.score = score
        self.extract = extract
        self.settings = settings
        self.samples: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self.prompts)

    def __call__(self, step: int = 0, progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
        """Evaluate now; ``progress(done, total)`` hears of every finished batch of prompts."""
        s = self.settings
        total = len(self.prompts)
        sampled = SamplingParams(n=s.n_samples, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                 seed=s.seed, stop=s.stop)
        greedy = dataclasses.replace(sampled, n=1, temperature=1.0, top_k=1)
        scores: list[list[float]] = []
        answers: list[list[Any]] = []
        greedy_scores: list[float] = []
        self.samples = []
        for start in range(0, total, s.batch_prompts):
            idx = list(range(start, min(start + s.batch_prompts, total)))
            # each batch of prompts draws from a seed of its own (an engine seeds a call's prompts by their
            # place in it); the first keeps the run's seed, so an evaluation of one batch samples as it did
            seed = s.seed if start == 0 else derived_seed(s.seed, "eval", start)
            rows, texts = self._scored(idx, dataclasses.replace(sampled, seed=seed), step)
            scores += rows
            answers += [[self.extract(t, self._row(i)) for t in ts] for i, ts in zip(idx, texts)]
            greedy_rows, greedy_texts = self._scored(idx, greedy, step)
            greedy_scores += [r[0] for r in greedy_rows]
            if s.keep_samples:
                self.samples += [self._record(i, step, texts[j], rows[j], answers[i], greedy_texts[j][0],
                                              greedy_rows[j][0]) for j, i in enumerate(idx)]
            if progress is not None:
                progress(idx[-1] + 1, total)
        labels = self.prompts.columns.get("label")
        out = summarise(scores, answers if labels is not None else None, labels, s.n_samples, s.threshold)
        out["greedy"] = sum(x >= s.threshold for x in greedy_scores) / len(greedy_scores)
        return out

    def _record(self, i: int, step: int, texts: list[str], scores: list[float], answers: list[Any], greedy: str,
                greedy_score: float) -> dict[str, Any]:
        """A held-out prompt's samples: each one's completion, score, extracted answer and whether it is
        correct, and the greedy sample's (``eval.log_samples``)."""
        threshold = self.settings.threshold
        return {"step": step, "prompt": self.prompts.prompts[i],
                "columns": {k: v[i] for k, v in self.prompts.columns.items() if isinstance(v[i], PLAIN)},
                "samples": [{"completion": t, "score": s, "answer": a, "correct": s >= threshold}
                            for t, s, a in zip(texts, scores, answers)],
                "greedy": {"completion": greedy, "score": greedy_score, "correct": greedy_score >= threshold}}

    def _row(self, i: int) -> dict[str, Any]:
        return {"prompt": self.prompts.prompts[i], **{k: v[i] for k, v in self.prompts.columns.items()}}

    def _scored(self, idx: list[int], params: SamplingParams, step: int) -> tuple[list[list[float]], list[list[str]]]:
        if self.sample is not None:
            samples, texts, extra = self.sample(idx, params)
        else:
            samples = self.engine.generate([self.prompts.prompt_ids[i] for i in idx], params)
            texts, extra = self.tokenizer.batch_decode(samples.completion_ids, skip_special_tokens=True), {}
        values = [float(v) for v in self.score([idx[j] for j in samples.prompt_index], samples, texts, step, extra)]
        n = params.n
        return ([values[j * n:(j + 1) * n] for j in range(len(idx))],
                [texts[j * n:(j + 1) * n] for j in range(len(idx))])
