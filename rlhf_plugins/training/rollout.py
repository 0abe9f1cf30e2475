"""A rollout: what one step generated and how it was scored, and its tensor batch."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

#: ``--learner.pad_to_multiple_of`` when it is 0 and the learner replays CUDA graphs: batch widths in
#: steps of 64 tokens (a few graphs per run; at most 63 masked tokens more per row)
GRAPH_WIDTH_MULTIPLE = 64


@dataclass
class Rollout:
    """Per-sample lists (``n`` consecutive samples per prompt)."""

    prompts: list[Any]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    completions: list[str]
    finish_reasons: list[str]
    rollout_logprobs: list[list[float]]
    columns: dict[str, list[Any]]
    group_size: int
    #: combined score per sample (weighted sum over reward functions)
    scores: list[float] = field(default_factory=list)
    #: each reward function's scores, by name (None where a function abstained)
    reward_components: dict[str, list[float | None]] = field(default_factory=dict)
    #: the combined score before shaping (penalties, normalisation, clipping)
    raw_scores: list[float] = field(default_factory=list)
    #: what dynamic filtering compares where a reward source returned OpenRLHF's ``scores`` (empty:
    #: the shaped ``scores``)
    filter_scores: list[float] = field(default_factory=list)
    #: the policy version (updates its weights had) that sampled each completion token
    versions: list[list[int]] = field(default_factory=list)
    #: multi-turn: 1 on the model's tokens, 0 on environment output (empty: every token is the model's)
    action_masks: list[list[int]] = field(default_factory=list)
    #: what generating it measured (multi-turn: turns, tool calls, finish reasons)
    metrics: dict[str, float] = field(default_factory=dict)
    #: columns reward functions added with TRL's ``log_extra``: a value per sample (samples.jsonl shows them)
    extra: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def scored(self) -> torch.Tensor | None:
        """``[B]`` bool: False on a sample every reward source abstained on (None); None when none did."""
        parts = list(self.reward_components.values())
        flags = [any(p[i] is not None for p in parts) for i in range(len(self))] if parts else []
        return None if all(flags) else torch.tensor(flags)

    def select_groups(self, groups: list[int] | range) -> Rollout:
        """The samples of the given prompt groups, in that order."""
        g = self.group_size
        idx = [i for grp in groups for i in range(grp * g, (grp + 1) * g)]

        def pick(values: list[Any]) -> list[Any]:
            return [values[i] for i in idx] if values else values

        return Rollout(
            prompts=pick(self.prompts),
            prompt_ids=pick(self.prompt_ids),
            completion_ids=pick(self.completion_ids),
            completions=pick(self.completions),
            finish_reasons=pick(self.finish_reasons),
            rollout_logprobs=pick(self.rollout_logprobs),
            columns={k: pick(v) for k, v in self.columns.items()},
            group_size=g,
            scores=pick(self.scores),
            reward_components={k: pick(v) for k, v in self.reward_components.items()},
            raw_scores=pick(self.raw_scores),
            filter_scores=pick(self.filter_scores),
            versions=pick(self.versions),
            action_masks=pick(self.action_masks),
            extra={k: pick(v) for k, v in self.extra.items()},
        )

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        first = parts[0]

        def cat(name: str) -> list[Any]:
            return [x for p in parts for x in getattr(p, name)]

        return Rollout(
            prompts=cat("prompts"),
            prompt_ids=cat("prompt_ids"),
            completion_ids=cat("completion_ids"),
            completions=cat("completions"),
            finish_reasons=cat("finish_reasons"),
            rollout_logprobs=cat("rollout_logprobs"),
            columns={k: [x for p in parts for x in p.columns[k]] for k in first.columns},
            group_size=first.group_size,
            scores=cat("scores"),
            reward_components={k: [x for p in parts for x in p.reward_components[k]] for k in first.reward_components},
            raw_scores=cat("raw_scores"),
            filter_scores=cat("filter_scores") if all(p.filter_scores for p in parts) else [],
            versions=cat("versions"),
            action_masks=cat("action_masks"),
            extra={k: [x for p in parts for x in p.extra.get(k, [None] * len(p))] for k in
                   dict.fromkeys(k for p in parts for k in p.extra)},
        )


def make_batch(rollout: Rollout, pad_id: int, multiple: int = 1,
               budgets: tuple[int | None, int | None] = (None, None)) -> dict[str, torch.Tensor]:
    """Left-pad prompts, right-pad completions: ``sequences = [prompt | completion]`` (filled by
    scatter from the flattened lists: no per-row tensor). The prompt and completion widths are the
    longest prompt's and completion's, rounded up to a ``multiple`` but not past their ``budgets``
    (:func:`padded_width`)."""
    B = len(rollout)
    P = padded_width(max(len(p) for p in rollout.prompt_ids), multiple, budgets[0])
    T = padded_width(max(max(len(c) for c in rollout.completion_ids), 1), multiple, budgets[1])
    sequences = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + T), dtype=torch.long)
    action = torch.zeros((B, T), dtype=torch.float32)
    rollout_lp = torch.zeros((B, T), dtype=torch.float32)
    p_rows, p_cols = _ragged(rollout.prompt_ids, left=P)
    sequences[p_rows, p_cols] = torch.tensor(list(chain.from_iterable(rollout.prompt_ids)), dtype=torch.long)
    attention[p_rows, p_cols] = 1
    c_rows, c_cols = _ragged(rollout.completion_ids)
    if len(c_rows):
        completions = rollout.completion_ids
        sequences[c_rows, P + c_cols] = torch.tensor(list(chain.from_iterable(completions)), dtype=torch.long)
        attention[c_rows, P + c_cols] = 1
        if rollout.action_masks:
            action[c_rows, c_cols] = torch.tensor(list(chain.from_iterable(rollout.action_masks)), dtype=torch.float32)
        else:
            action[c_rows, c_cols] = 1.0
        lps = rollout.rollout_logprobs
        if any(len(lp) != len(c) for lp, c in zip(lps, completions)):
            lps = [lp[: len(c)] for lp, c in zip(lps, completions)]
        rollout_lp[c_rows, c_cols] = torch.tensor(list(chain.from_iterable(lps)), dtype=torch.float32)
    return {
        "sequences": sequences,
        "attention_mask": attention,
        "action_mask": action,
        "rollout_logprobs": rollout_lp,
        "scores": torch.tensor(rollout.scores, dtype=torch.float32),
        # layout hints: samples of one prompt are consecutive and share the first P columns (not so
        # when an environment's reset gave samples of one prompt different prompts)
        "group_size": rollout.group_size,
        "prompt_width": P if _groups_share_prompts(rollout) else None,
    }


def padded_width(width: int, multiple: int, budget: int | None = None) -> int:
    """``width`` rounded up to a multiple of ``multiple``, but not past ``budget`` (the configured
    longest prompt or completion) when ``width`` is within it: a run's batches then take a few widths
    instead of a new one each step (``--learner.pad_to_multiple_of``: CUDA graphs are recorded per
    shape, compiled code specialises on some; the padding is masked out of every pass and loss)."""
    if multiple <= 1:
        return width
    up = -(-width // multiple) * multiple
    return up if budget is None or width > budget else min(up, budget)


def batch_widths(config: Any, plan: Any = None) -> dict[str, Any]:
    """:func:`make_batch`'s ``multiple`` and ``budgets`` for a run: ``--learner.pad_to_multiple_of``, or
    with 0, 64 when the learner replays CUDA graphs (``--learner.compile_mode reduce-overhead`` or
    ``max-autotune``) and no padding otherwise; the budgets are the longest prompt and completion the
    run allows (an environment's ``--env.max_total_tokens`` when ``plan`` has one), as the memory plan sizes them."""
    from ..models.compiled import replays_graphs

    learner = config.learner
    multiple = learner.pad_to_multiple_of or (GRAPH_WIDTH_MULTIPLE if replays_graphs(learner) else 1)
    env = plan is not None and getattr(plan, "environment", None) is not None
    completion = config.env.max_total_tokens if env else config.generation.max_new_tokens
    return {"multiple": multiple, "budgets": (config.data.max_prompt_tokens, completion)}


def _ragged(rows: list[list[Any]], left: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every element of ragged ``rows`` laid out from column 0, or ending at
    column ``left`` (left padding)."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    col = torch.arange(int(lengths.sum())) - starts[row]
    return row, col if left is None else col + (left - lengths)[row]


def _groups_share_prompts(rollout: Rollout) -> bool:
    g, ids = rollout.group_size, rollout.prompt_ids
    return all(ids[i] == ids[i - i % g] for i in range(len(ids)))


def rollout_metrics(rollout: Rollout, batch: dict[str, torch.Tensor], kl_penalty: torch.Tensor | None,
                    kl_coef: float) -> dict[str, float]:
    """What a step's samples looked like: the spread of their rewards (before shaping, as ``reward/mean``)
    and the share of prompts whose rewards are all equal, lengths, stops, advantages, each reward
    function's mean, and the KL that entered the reward (in KL units, before the coefficient)."""
    from ..algorithms.numerics import masked_mean

    mask = batch["action_mask"]
    scores = batch["scores"]
    raw = torch.tensor(rollout.raw_scores or scores.tolist(), dtype=torch.float64)  # before shaping
    adv_mean = masked_mean(batch["advantages"], mask)
    out = {
        "reward/std": float(raw.std()) if len(raw) > 1 else 0.0,
        **_lengths(rollout, mask),
        "advantage/mean": float(adv_mean),
        "advantage/std": float(masked_mean((batch["advantages"] - adv_mean) ** 2, mask).sqrt()),
    }
    if len(raw) % max(1, rollout.group_size) == 0:  # prompts whose samples give a group baseline no signal
        groups = raw.view(-1, max(1, rollout.group_size))
        out["reward/zero_std_frac"] = float((groups.amax(1) - groups.amin(1)).le(1e-12).double().mean())
    if rollout.scores != rollout.raw_scores:
        out["reward/shaped_mean"] = float(scores.mean())
    for name, values in rollout.reward_components.items():  # each source's, a single one's too (as TRL logs)
        vals = [v for v in values if v is not None]
        if vals:  # the mean and the (unbiased) spread of the samples it scored: TRL's rewards/<name>/mean and /std
            out[f"reward/{name}"] = sum(vals) / len(vals)
            out[f"reward_std/{name}"] = float(torch.tensor(vals, dtype=torch.float64).std()) if len(vals) > 1 else 0.0
    if kl_penalty is not None:
        out["kl/rollout"] = float(masked_mean(kl_penalty, mask)) / max(kl_coef, 1e-12)
    return out


def _lengths(rollout: Rollout, mask: torch.Tensor) -> dict[str, float]:
    """The completions' lengths in the model's tokens (multi-turn: all its turns) -- all of them, and those that
    stopped of themselves (TRL's terminated lengths, 0 when none did) -- the share that stopped, and the prompt and
    completion tokens of the step (TRL's num_tokens counts them up)."""
    lengths = mask.sum(-1)
    stopped = torch.tensor([r == "stop" for r in rollout.finish_reasons], dtype=torch.bool)
    ended = lengths[stopped] if stopped.any() else lengths.new_zeros(1)
    return {"completion/length": float(lengths.mean()), "completion/min_length": float(lengths.min()),
            "completion/max_length": float(lengths.max()), "completion/stopped": float(stopped.double().mean()),
            "completion/terminated_length": float(ended.double().mean()),
            "completion/min_terminated_length": float(ended.min()),
            "completion/max_terminated_length": float(ended.max()),
            "tokens/step": float(sum(len(p) for p in rollout.prompt_ids) + lengths.sum())}


def mask_truncated(batch: dict[str, Any], rollout: Rollout) -> dict[str, Any]:
    """Take the completions that did not stop (cut off by the budget) out of the loss: their
    ``action_mask`` rows become 0 (a new tensor; the one before is left as it was). Returns the batch
    as generated, for the step's metrics (lengths, tokens per second)."""
    shown = dict(batch)
    keep = torch.tensor([r == "stop" for r in rollout.finish_reasons], dtype=batch["action_mask"].dtype)
    batch["action_mask"] = batch["action_mask"] * keep[:, None]
    return shown


#: the seconds of each forward pass, by batch key, as metric names
PASS_NAMES = {"old_logprobs": "actor_logprobs", "ref_logprobs": "reference", "values": "critic_values"}


def step_timings(batch: dict[str, torch.Tensor], timings: dict[str, float], t0: float, t_gen: float, t_prep: float,
                 t_train: float, t_end: float) -> dict[str, float]:
    """Seconds of each phase of a step and the tokens per second they processed."""
    tokens = float(batch["action_mask"].sum())
    seq_tokens = float(batch["attention_mask"].sum())  # prompt + completion: what forwards process
    return {
        "time/generate": t_gen - t0,
        "time/prepare": t_prep - t_gen,
        "time/train": t_train - t_prep,
        "time/sync": t_end - t_train,
        "time/step": t_end - t0,
        "throughput/generated_tokens_per_s": tokens / max(t_gen - t0, 1e-9),
        "throughput/train_tokens_per_s": seq_tokens / max(t_train - t_prep, 1e-9),
        **{f"time/{PASS_NAMES[k]}": v for k, v in timings.items()},
        **{f"throughput/{PASS_NAMES[k]}_tokens_per_s": seq_tokens / max(v, 1e-9) for k, v in timings.items()},
    }
