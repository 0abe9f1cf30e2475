"""Policy lag in asynchronous training: partial rollouts and the staleness of what is trained on.

With ``generation.partial_rollout`` the rollout worker generates in chunks of
``generation.partial_chunk_tokens`` and takes new weights between chunks: an unfinished
generation continues from its prefix (resubmitted to the engine, which works for every backend)
under the newest policy, and each token records the version that sampled it. Every step reports
the token-weighted lag of what it trained on.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..protocols import Samples, SamplingParams


class Stopped(Exception):
    """The rollout worker was asked to stop in the middle of a rollout."""


def partial_sample(worker: Any, prompt_ids: list[list[int]],
                   params: SamplingParams) -> tuple[Samples, list[list[int]]]:
    """Generate ``worker.chunk`` tokens at a time, taking new weights between chunks (the rollout
    worker's ``catch_up``); unfinished samples continue from their prefix, one sample per
    resubmitted prefix. The samples, and the policy version of each token."""
    t = worker.trainer
    first = dataclasses.replace(params, max_new_tokens=min(worker.chunk, params.max_new_tokens))
    out = t.engine.generate(prompt_ids, first)
    samples = Samples(list(out.prompt_index), [list(x) for x in out.completion_ids],
                      [list(x) for x in out.logprobs], list(out.finish_reasons))
    versions = [[t.engine_version] * len(x) for x in samples.completion_ids]
    rounds = 1
    while True:
        open_ = [j for j, (ids, why) in enumerate(zip(samples.completion_ids, samples.finish_reasons))
                 if why == "length" and len(ids) < params.max_new_tokens]
        if not open_:
            break
        if worker.stopping:
            raise Stopped
        worker.catch_up()
        done = len(samples.completion_ids[open_[0]])
        more = dataclasses.replace(
            params, n=1, max_new_tokens=min(worker.chunk, params.max_new_tokens - done),
            seed=None if params.seed is None else params.seed + 7919 * rounds,
        )
        prefixes = [prompt_ids[samples.prompt_index[j]] + samples.completion_ids[j] for j in open_]
        cont = t.engine.generate(prefixes, more)
        for j, ids, lps, why in zip(open_, cont.completion_ids, cont.logprobs, cont.finish_reasons):
            samples.completion_ids[j] += list(ids)
            samples.logprobs[j] += list(lps)
            samples.finish_reasons[j] = why
            versions[j] += [t.engine_version] * len(ids)
        rounds += 1
    return samples, versions


def staleness_metrics(step: int, versions: list[list[int]]) -> dict[str, float]:
    """Token-weighted lag (``step`` minus the version that sampled each token): mean, max, and
    the fraction of tokens at each lag."""
    lags = [step - v for seq in versions for v in seq]
    if not lags:
        return {}
    out = {"async/staleness_mean": sum(lags) / len(lags), "async/staleness_max": float(max(lags))}
    for lag in sorted(set(lags)):
        out[f"async/tokens_lag{lag}"] = lags.count(lag) / len(lags)
    return out
