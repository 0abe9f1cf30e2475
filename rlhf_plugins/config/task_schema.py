"""Config sections of what a run is evaluated on (``eval``) and of the multi-turn environments its
prompts may run in (``env``); part of :class:`rlhf_plugins.config.schema.Config`."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..settings import setting


@dataclass
class EvalConfig:
    #: false: no held-out evaluation
    enabled: bool = True
    #: held-out prompts (file, folder or builtin:NAME; same columns as the training data); empty: the
    #: built-in task's test split when training on the built-in task, else ``split`` of the training data
    path: str | None = None
    #: hold out this fraction of the training prompts for evaluation (when ``path`` is empty)
    split: float = setting(0.0, ge=0, lt=1)
    #: evaluate every N steps; always before the first step and after the last (0: only then)
    every: int = setting(0, ge=0)
    #: samples per prompt at ``temperature`` (k of pass@k, mean@k, maj@k), plus one greedy sample
    n_samples: int = setting(8, ge=1)
    #: sampling temperature of the evaluation samples
    temperature: float = setting(1.0, gt=0)
    #: empty: generation.max_new_tokens
    max_new_tokens: int | None = setting(None, ge=1)
    #: evaluate the first N held-out prompts only (0: all)
    max_prompts: int = setting(0, ge=0)
    #: reward functions that judge a sample (their sum); empty: the training reward
    reward_functions: list[str] = field(default_factory=list)
    #: a sample is correct when its score is at least this
    threshold: float = setting(1.0)
    #: prompts per generation call (each call draws with a seed of its own, the first with --train.seed)
    batch_prompts: int = setting(64, ge=1)
    #: write each evaluation's samples to ``<run>/eval_samples.jsonl``, a row per held-out prompt: its
    #: samples' completions, scores, answers and correctness, and the greedy sample's (``rlhf eval``: the
    #: report's ``samples``)
    log_samples: bool = False


@dataclass
class EnvConfig:
    #: multi-turn environment of every row; empty: single-turn unless rows name one in ``column``
    name: str | None = None
    #: a data column naming each row's environment (else ``name``)
    column: str = "environment"
    #: model turns per trajectory (after the last, finish reason max_turns)
    max_turns: int = setting(4, ge=1)
    #: tokens of a trajectory after the prompt, model and environment (TRL's max_completion_length)
    max_total_tokens: int = setting(256, ge=1)
    #: tokens of one model turn; empty: what is left of max_total_tokens (not generation.max_new_tokens)
    max_turn_tokens: int | None = setting(None, ge=1)
    #: environment steps (tool calls) run at the same time
    concurrency: int = setting(16, ge=1)
