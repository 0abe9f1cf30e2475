"""How a role of several ranks runs a method: the marks role classes carry, and the pure helpers
a placement uses to honour them (shard a batch, balance prompts, merge results).

A role class marks each method with :func:`dispatch`; a placement with one rank per role ignores
the marks, one with several (Ray) reads them with :func:`dispatch_mode`:

* ``"split"`` -- the first argument (a batch) is cut into one shard per rank at prompt-group
  boundaries (:func:`shard_batch`; an object with ``split(n)`` cuts itself); tensor results are
  concatenated, metric dicts averaged, results whose class has ``merge(results)`` merged by it
  (:func:`merge_results`).
* ``"all"`` -- every rank runs it with the same arguments (collectives such as ZeRO-3 gathers);
  the result of rank 0 is returned.
* ``"prompts"`` -- a list of prompts is spread over the ranks (engines) by load (:func:`balance`);
  the samples come back in prompt order (:func:`merge_samples`).
* ``"one"`` (unmarked methods) -- rank 0 alone.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .backend_data import SamplingParams, derived_seed
from .protocols import Samples

MODES = ("split", "all", "prompts", "one")


def dispatch(mode: str) -> Callable[[Any], Any]:
    """Mark a role method with how several ranks run it (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown dispatch mode '{mode}'; choose one of: {', '.join(MODES)}")

    def mark(fn: Any) -> Any:
        fn.__rlhf_dispatch__ = mode
        return fn

    return mark


def dispatch_mode(cls: type, name: str) -> str:
    return getattr(getattr(cls, name, None), "__rlhf_dispatch__", "one")


def _is_tensor(v: Any) -> bool:
    return type(v).__module__.startswith("torch") and hasattr(v, "shape")


def shard_batch(batch: dict[str, Any], n: int, objective: Any = None) -> list[dict[str, Any]]:
    """``n`` consecutive shards with whole prompt groups in each (single samples when the batch
    is not made of whole groups); tensors and lists are cut, other values copied to every shard.

    With an ``objective`` (``train``), each shard carries ``dp_weight``: its share of the global
    loss times ``n`` (data-parallel learners average gradients over ranks)."""
    if callable(getattr(batch, "split", None)):
        return batch.split(n)
    B = batch["sequences"].shape[0]
    group = int(batch.get("group_size", 1))
    unit = group if B % group == 0 else 1
    units = B // unit
    if objective is not None and batch.get("balance_tokens"):
        # packed micro batches: ranks get about equal real tokens (whole groups, longest first)
        loads = batch["attention_mask"].view(units, -1).sum(-1).tolist()
        shards = [_select(batch, [u * unit + j for u in share for j in range(unit)]) for share in balance(loads, n)]
    else:
        sizes = [units // n + (1 if i < units % n else 0) for i in range(n)]
        shards, start = [], 0
        for size in sizes:
            stop = start + size * unit
            shards.append({k: v[start:stop] if _is_tensor(v) or isinstance(v, list) else v for k, v in batch.items()})
            start = stop
    weigh = getattr(objective, "weight", None)
    if callable(weigh):
        for shard in shards:
            shard["dp_weight"] = weigh(shard["action_mask"], batch["action_mask"]) * n
    return shards


def _select(batch: dict[str, Any], idx: list[int]) -> dict[str, Any]:
    def pick(v: Any) -> Any:
        if _is_tensor(v):
            return v[idx]
        return [v[i] for i in idx] if isinstance(v, list) else v

    return {k: pick(v) for k, v in batch.items()}


def balance(loads: list[int], n: int) -> list[list[int]]:
    """Indices split into ``n`` shares of about equal total load (longest first, to the lightest)."""
    shares: list[list[int]] = [[] for _ in range(n)]
    totals = [0] * n
    for i in sorted(range(len(loads)), key=lambda i: -loads[i]):
        k = totals.index(min(totals))
        shares[k].append(i)
        totals[k] += loads[i]
    return [sorted(s) for s in shares]


def share_arguments(args: tuple, kwargs: dict[str, Any], share: int) -> tuple[tuple, dict[str, Any]]:
    """The arguments of one engine's call in a ``"prompts"`` dispatch (``args[0]``, the prompts, is
    cut by the caller): seeded sampling parameters get the seed ``derived_seed(seed, "engine", share)``,
    as every engine seeds its own call -- with the call's seed each would draw its first prompt's
    samples from the stream of every other engine's first prompt."""

    def own(value: Any) -> Any:
        if isinstance(value, SamplingParams) and value.seed is not None:
            return dataclasses.replace(value, seed=derived_seed(value.seed, "engine", share))
        return value

    return tuple(own(a) for a in args), {k: own(v) for k, v in kwargs.items()}


def merge_results(results: list[Any]) -> Any:
    """Tensors concatenated in rank order, metric dicts averaged, objects whose class has
    ``merge(results)`` merged by it, anything else rank 0's."""
    first = results[0]
    merge = getattr(type(first), "merge", None)
    if callable(merge):
        return merge(results)
    if _is_tensor(first):
        import torch

        return torch.cat(results)
    if isinstance(first, dict) and all(isinstance(v, (int, float)) for v in first.values()):
        return {k: sum(r[k] for r in results) / len(results) for k in first}
    return first


def merge_samples(shares: list[list[int]], parts: list[Samples]) -> Samples:
    """Samples of several engines (``parts[k]`` generated for the prompts ``shares[k]``) back in
    prompt order, each prompt's samples in the order its engine returned them."""
    rows = []
    for idx, part in zip(shares, parts):
        for j in range(len(part)):
            rows.append((idx[part.prompt_index[j]], j, part))
    rows.sort(key=lambda r: (r[0], r[1]))
    out = Samples()
    for prompt, j, part in rows:
        out.prompt_index.append(prompt)
        out.completion_ids.append(part.completion_ids[j])
        out.logprobs.append(part.logprobs[j])
        out.finish_reasons.append(part.finish_reasons[j])
    return out
