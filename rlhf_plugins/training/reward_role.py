"""The reward role: every reward source of the run -- reward functions, reward models, remote
reward servers -- scores the samples; each score is checked, retried when asked to, bounded in
time, and combined by weight. Under Ray the role may have several ranks (``--ray.reward_workers``):
a :class:`RewardBatch` splits itself across them and the :class:`RewardResult`\\ s merge back."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.manager import get_manager
from ..core.spec import PluginSpec
from ..dispatch import dispatch
from ..errors import RewardError, UsageError
from ..types import RewardFunction
from . import host_memory
from .reward_values import absent_columns, call_with_timeout, rewards_and_scores
from .roles import Role

logger = logging.getLogger("rlhf_plugins")


@dataclass
class RewardBatch:
    """The samples of one step, as reward sources see them."""

    prompts: list[Any]
    completions: list[str]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    step: int = 0
    #: prompt (as the policy saw it, template included) + completion texts, and the prompts alone,
    #: for reward servers
    queries: list[str] | None = None
    prompt_texts: list[str] | None = None
    #: the policy's prompt tokens and why each completion ended, for reward models
    prompt_ids: list[list[int]] | None = None
    finish_reasons: list[str] | None = None
    #: scored for a held-out evaluation (of the policy after ``step`` updates), not for training
    evaluation: bool = False
    #: passes over the training prompts before this batch's were drawn (TRL's ``trainer_state.epoch``)
    epoch: float = 0.0

    @property
    def when(self) -> str:
        return f"in the evaluation after {self.step} steps" if self.evaluation else f"at step {self.step}"

    def __len__(self) -> int:
        return len(self.completions)

    @classmethod
    def of(cls, tokenizer: Any, prompts: list[Any], prompt_ids: list[list[int]], completion_ids: list[list[int]],
           completions: list[str], columns: dict[str, list[Any]], step: int, finish_reasons: list[str],
           with_texts: bool, evaluation: bool = False, epoch: float = 0.0) -> RewardBatch:
        """The batch for sampled completions; ``with_texts`` adds the texts reward servers read
        (prompt as the policy saw it, template included, and prompt + completion)."""
        queries = texts = None
        if with_texts:
            decode = tokenizer.batch_decode
            texts = decode(prompt_ids, skip_special_tokens=False)
            queries = decode([p + q for p, q in zip(prompt_ids, completion_ids)], skip_special_tokens=False)
        return cls(prompts, completions, completion_ids, columns, step, queries, texts, prompt_ids, finish_reasons,
                   evaluation, epoch)

    def split(self, n: int) -> list[RewardBatch]:
        """``n`` consecutive shards of about equal size (data-parallel scoring)."""
        sizes = [len(self) // n + (1 if i < len(self) % n else 0) for i in range(n)]
        out, start = [], 0
        for size in sizes:
            stop = start + size
            out.append(RewardBatch(self.prompts[start:stop], self.completions[start:stop],
                                   self.completion_ids[start:stop],
                                   {k: v[start:stop] for k, v in self.columns.items()}, self.step,
                                   *(None if v is None else v[start:stop] for v in (
                                       self.queries, self.prompt_texts, self.prompt_ids, self.finish_reasons)),
                                   self.evaluation, self.epoch))
            start = stop
        return out


@dataclass
class RewardResult:
    """Combined scores, each source's scores by name (None where a source abstained), retries."""

    scores: list[float]
    parts: dict[str, list[float | None]]
    retries: int = 0
    #: what reward functions logged with TRL's ``log_metric(name, value)``: every value by name
    logged: dict[str, list[float]] = field(default_factory=dict)
    #: what dynamic filtering compares, where a source returned OpenRLHF's ``{"rewards", "scores"}``:
    #: the weighted sum with that source's ``scores`` in place of its rewards (None: no source did)
    filter_scores: list[float] | None = None
    #: columns reward functions added with TRL's ``log_extra(column, values)``: a value per sample
    extra: dict[str, list[Any]] = field(default_factory=dict)

    @classmethod
    def merge(cls, results: list[RewardResult]) -> RewardResult:
        parts = {k: [x for r in results for x in r.parts[k]] for k in results[0].parts}
        logged: dict[str, list[float]] = {}
        for r in results:
            for name, values in r.logged.items():
                logged.setdefault(name, []).extend(values)
        filtered = None
        if any(r.filter_scores is not None for r in results):
            filtered = [x for r in results for x in (r.scores if r.filter_scores is None else r.filter_scores)]
        columns = dict.fromkeys(k for r in results for k in r.extra)  # a part whose functions left one out: None
        extra = {k: [x for r in results for x in r.extra.get(k, [None] * len(r.scores))] for k in columns}
        return cls([x for r in results for x in r.scores], parts, sum(r.retries for r in results), logged, filtered,
                   extra)


def whole_columns(extra: dict[str, list[Any]], n: int, when: str) -> dict[str, list[Any]]:
    """The ``log_extra`` columns with a value for each of the ``n`` samples; a warning names any other."""
    for column, values in extra.items():
        if len(values) != n:
            logger.warning("log_extra('%s') gave %d values for the %d samples %s; the column is left out",
                           column, len(values), n, when)
    return {column: values for column, values in extra.items() if len(values) == n}


@dataclass(frozen=True)
class TrainerState:
    """What TRL hands reward functions as ``trainer_state`` (the fields they read of transformers'
    TrainerState): the updates made so far, the run's length, the epoch over the prompts."""

    global_step: int
    max_steps: int
    epoch: float = 0.0
    log_history: tuple = ()


@dataclass
class Source:
    name: str
    where: str  # "plugin 'x'", "reward model", "remote"
    fn: Callable[..., Any]
    weight: float


def reads_texts(pm: Any, names: list[str], remote_urls: list[str] | None = None) -> bool:
    """Whether the reward sources read the policy's rendered texts (``RewardBatch.queries`` and
    ``prompt_texts``): a reward server, or a function that asks for them (an OpenRLHF ``reward_func``)."""
    if remote_urls:
        return True
    funcs = (pm.components.get(RewardFunction, name).func for name in names)
    return any(getattr(fn, "wants_queries", False) for fn in funcs)


def build_sources(config: Any, pm: Any, names: list[str], weights: list[float]) -> list[Source]:
    """Functions by name, then reward models, then the remote servers, in the order of ``weights``."""
    r = config.reward
    sources = []
    for name, weight in zip(names, weights):
        comp = pm.components.get(RewardFunction, name)
        provider = pm.components.provider(RewardFunction, name)
        sources.append(Source(name, f"plugin '{provider}'", comp.build(config), weight))
    model_weights = weights[len(names):]
    if r.models:
        from transformers import AutoTokenizer

        from ..data.prompts import use_chat_template
        from ..models.reward_model import RewardModelScorer, applies_stored_stats
        from ..models.tiny_model import default_model_path

        policy = AutoTokenizer.from_pretrained(config.model.path or default_model_path(quiet=True),
                                               trust_remote_code=config.model.trust_remote_code)
        use_chat_template(policy, config.data)  # the policy's prompts as rendered (to compare with the model's)
        for path, weight in zip(r.models, model_weights):
            scorer = RewardModelScorer(path, config.model.dtype, r.model_batch_size, r.value_head_prefix,
                                       policy_tokenizer=policy, normalize=applies_stored_stats(r),
                                       template_kwargs=config.data.chat_template_kwargs)
            sources.append(Source(scorer.name, "reward model", _model_source(scorer), weight))
    if r.remote_urls:
        from ..rewards.remote import RemoteReward

        sources.append(Source("remote", "remote", RemoteReward.from_config(r), model_weights[len(r.models)]))
    return sources


def _model_source(scorer: Any) -> Callable[..., Any]:
    def score(prompts: list[Any], completions: list[str], completion_ids: list[list[int]] | None = None,
              prompt_ids: list[list[int]] | None = None, finish_reasons: list[str] | None = None,
              **kwargs: Any) -> list[float]:
        return scorer(prompts, completions, prompt_ids, completion_ids, finish_reasons)

    score.wants_tokens = True  # type: ignore[attr-defined]
    return score


class RewardRole(Role):
    """Runs every reward source, checks its output, combines the sources by weight."""

    role = "reward"

    def __init__(self, config: Any, plugin_spec: PluginSpec, names: list[str], weights: list[float]) -> None:
        if config.reward.models:  # reward models run forwards here; functions and servers need no tuning, and
            host_memory.apply(config)  # its look at the model's size would import torch and transformers
        self.sources = build_sources(config, get_manager(plugin_spec), names, weights)
        self.backend = self.sources
        self.max_retries = config.reward.max_retries
        self.timeout = config.reward.timeout or None
        self.max_steps = config.train.steps
        self.updates_per_step = config.updates_per_step()  # TRL's trainer_state counts optimizer updates

    def _call(self, source: Source, batch: RewardBatch, where: str, logged: dict[str, list[float]],
              extra: dict[str, list[Any]]) -> Any:
        kwargs = dict(prompts=batch.prompts, completions=batch.completions, completion_ids=batch.completion_ids,
                      **batch.columns)
        log_metric = lambda name, value: logged.setdefault(str(name), []).append(float(value))  # noqa: E731
        if source.where.startswith("plugin"):  # TRL passes these to every reward function
            state = TrainerState(batch.step * self.updates_per_step, self.max_steps * self.updates_per_step,
                                 batch.epoch)
            log_extra = lambda column, values: extra.setdefault(str(column), []).extend(values)  # noqa: E731
            kwargs.update(trainer_state=state, log_metric=log_metric, log_extra=log_extra)
        elif getattr(source.fn, "logs_metrics", False):
            kwargs.update(log_metric=log_metric)
        if getattr(source.fn, "wants_queries", False):
            kwargs.update(queries=batch.queries, prompt_texts=batch.prompt_texts)
        if getattr(source.fn, "wants_tokens", False):
            kwargs.update(prompt_ids=batch.prompt_ids, finish_reasons=batch.finish_reasons)
        if self.timeout is None:
            return source.fn(**kwargs)
        return call_with_timeout(source.fn, kwargs, self.timeout, f"{where} did not return within "
                                 f"{self.timeout:g} s (--reward.timeout)")

    @dispatch("split")
    def score(self, batch: RewardBatch) -> RewardResult:
        n = len(batch)
        combined = [0.0] * n
        parts: dict[str, list[float | None]] = {}
        logged: dict[str, list[float]] = {}
        extra: dict[str, list[Any]] = {}
        retries, compared = 0, []
        for source in self.sources:
            where = f"reward '{source.name}' ({source.where}) {batch.when}"
            for attempt in range(self.max_retries + 1):
                try:
                    added: dict[str, list[Any]] = {}  # log_extra's columns of this attempt
                    out = self._call(source, batch, where, logged, added)
                    extra.update(added)
                    break
                except RewardError as exc:
                    if attempt == self.max_retries:
                        raise
                    retries += 1
                    logger.warning("%s; retrying (%d of %d)", exc, attempt + 1, self.max_retries)
                except UsageError:
                    raise
                except SystemExit as exc:
                    raise RewardError(f"{where} called sys.exit({exc.code!r}); a reward must return scores "
                                      "or raise") from None
                except Exception as exc:
                    if attempt == self.max_retries:
                        tried = f" (after {attempt} retries)" if attempt else ""
                        line = f"{where} raised {type(exc).__name__}: {exc}".splitlines()[0]
                        raise RewardError(f"{line}{tried}{absent_columns(source.fn, batch.columns)}") from exc
                    retries += 1
                    logger.warning("%s raised %s: %s; retrying (%d of %d)", where, type(exc).__name__, exc,
                                   attempt + 1, self.max_retries)
                    time.sleep(min(0.1 * 2**attempt, 5.0))
            values, given = rewards_and_scores(out, where, n)
            for i, v in enumerate(values):
                if v is not None:
                    combined[i] += source.weight * v
            parts[source.name] = values
            compared.append((source.weight, values if given is None else given, given is not None))
        if n and all(v is None for values in parts.values() for v in values):
            names = ", ".join(f"'{s.name}'" for s in self.sources)
            raise RewardError(f"every reward source ({names}) returned None for all {n} samples {batch.when}: None "
                              "means a reward does not apply to a sample; one must apply to each")
        filtered = None
        if any(own for _, _, own in compared):  # OpenRLHF's scores: what dynamic filtering compares
            filtered = [sum(w * (v[i] or 0.0) for w, v, _ in compared) for i in range(n)]
        return RewardResult(combined, parts, retries, logged, filtered, whole_columns(extra, n, batch.when))

    def shutdown(self) -> None:
        for source in self.sources:
            close = getattr(source.fn, "close", None)
            if callable(close):
                close()
