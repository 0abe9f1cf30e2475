"""A remote reward: OpenRLHF's reward-server protocol over HTTP, with bounded retries.

``POST URL`` with JSON ``{"query": [prompt + completion texts], "prompts": [prompt texts],
"labels": [labels]}``; the server answers ``{"rewards": [one number per query], ...}`` (also
``"scores"`` and ``"extra_logs"`` in OpenRLHF's servers). Samples go in batches of
``remote_batch_size``, at most ``remote_concurrency`` requests in flight, spread round-robin over
the URLs; each request is bounded by ``reward.timeout`` and retried with exponential backoff on
connection errors, timeouts and 5xx answers, ``remote_retries`` attempts in all. When they run out
the run stops with one line naming the URL and what came back -- never a hang.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import RewardError
from .callables import log_extra

logger = logging.getLogger("rlhf_plugins")


def _short(text: str, n: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


class RemoteReward:
    def __init__(self, urls: list[str], batch_size: int = 64, concurrency: int = 4, timeout: float = 300.0,
                 attempts: int = 3, backoff: float = 0.5) -> None:
        import httpx

        self.urls, self.batch_size, self.attempts, self.backoff = list(urls), batch_size, attempts, backoff
        self.client = httpx.Client(timeout=timeout or None, limits=httpx.Limits(max_connections=concurrency))
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="rlhf-remote-reward")
        self.wants_queries = True
        self.logs_metrics = True  # the servers' extra_logs, as OpenRLHF logs them

    @classmethod
    def from_config(cls, r: Any) -> RemoteReward:
        return cls(r.remote_urls, r.remote_batch_size, r.remote_concurrency, r.timeout, r.remote_retries)

    def __call__(self, prompts: list[Any], completions: list[str], queries: list[str] | None = None,
                 prompt_texts: list[str] | None = None, label: list[Any] | None = None,
                 log_metric: Callable[[str, float], None] | None = None, **kwargs: Any) -> Any:
        """``queries`` / ``prompt_texts``: the policy's rendered texts (template included), as
        OpenRLHF sends them; without them, the raw prompt and prompt + completion. The servers'
        ``extra_logs`` go to ``log_metric`` (each request's means). The rewards; or, where the servers'
        ``scores`` differ from them, ``{"rewards", "scores"}`` (a request's rewards stand in for scores it
        lacked): the scores are what dynamic filtering compares, as in OpenRLHF."""
        texts = prompt_texts or [p if isinstance(p, str) else str(p) for p in prompts]
        queries = queries or [p + c for p, c in zip(texts, completions)]
        labels = list(label) if label is not None else [""] * len(completions)  # OpenRLHF's, without a label key
        n, size = len(completions), self.batch_size
        chunks = [range(i, min(i + size, n)) for i in range(0, n, size)]
        urls = itertools.cycle(self.urls)
        jobs = [(next(urls), {"query": [queries[i] for i in c], "prompts": [texts[i] for i in c],
                              "labels": [labels[i] for i in c]}) for c in chunks]
        answers = list(self.pool.map(lambda job: self.post(*job), jobs))
        for _, _, extra in answers:
            log_extra(extra, log_metric)
        rewards = [x for r, _, _ in answers for x in r]
        scores = [x for r, given, _ in answers for x in (r if given is None else given)]
        return rewards if scores == rewards else {"rewards": rewards, "scores": scores}

    def post(self, url: str, payload: dict[str, list[Any]]) -> tuple[list[float], list[Any] | None, Any]:
        """One request's rewards, its ``scores`` (None without) and its ``extra_logs``, retried on
        connection errors and 5xx."""
        import httpx

        n, what = len(payload["query"]), ""
        for attempt in range(1, self.attempts + 1):
            try:
                response = self.client.post(url, json=payload)
            except httpx.TransportError as exc:  # refused, reset, timed out
                what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if response.status_code >= 500:
                    what = f"HTTP {response.status_code} ({_short(response.text) or response.reason_phrase})"
                elif response.status_code >= 400:
                    raise RewardError(f"reward server {url} refused the request: HTTP {response.status_code} "
                                      f"({_short(response.text) or response.reason_phrase})")
                else:
                    return self._rewards(url, response, n)
            if attempt < self.attempts:
                logger.warning("reward server %s: %s; retrying (%d of %d)", url, what, attempt, self.attempts - 1)
                time.sleep(self.backoff * 2 ** (attempt - 1))
        raise RewardError(f"reward server {url} failed {self.attempts} times; last: {what}")

    @staticmethod
    def _rewards(url: str, response: Any, n: int) -> tuple[list[float], list[Any] | None, Any]:
        try:
            data = response.json()
        except ValueError:
            raise RewardError(f"reward server {url} answered something that is not JSON: "
                              f"{_short(response.text)!r}") from None
        rewards = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(rewards, list):
            raise RewardError(f"reward server {url} answered without a 'rewards' list: {_short(response.text)!r}")
        if len(rewards) != n:
            raise RewardError(f"reward server {url} returned {len(rewards)} rewards for {n} queries")
        scores = data.get("scores")
        if scores is not None and (not isinstance(scores, list) or len(scores) != n):
            raise RewardError(f"reward server {url} answered 'scores' that are not a list of {n} numbers: "
                              f"{_short(str(scores))!r}")
        return rewards, scores, data.get("extra_logs")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
