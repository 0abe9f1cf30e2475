"""``rlhf serve-reward``: a reward model, or any registered reward function, behind OpenRLHF's
reward-server protocol (``POST /get_reward``).

FastAPI + uvicorn, as OpenRLHF's ``serve_rm`` and most model servers in this field use: an ASGI
server that many RL frameworks' clients already talk to. Requests that arrive together are scored
together: a batcher collects queries for up to ``max_wait_ms`` (or until ``batch_size``) and makes
one model call for all of them, in a worker thread so the event loop keeps accepting requests.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger("rlhf_plugins")


class RewardRequest(BaseModel):
    """OpenRLHF's request: the texts to score, and optionally their prompts and labels."""

    query: list[str]
    prompts: list[str] | None = None
    labels: list[Any] | None = None


@dataclass
class _Pending:
    queries: list[str]
    prompts: list[str]
    labels: list[Any]
    future: asyncio.Future = field(default=None)  # type: ignore[assignment]


class Batcher:
    """Gathers the queries of concurrent requests into batches of at most ``batch_size``. ``score``
    returns one reward per query, or OpenRLHF's ``{"rewards": [...], "scores": [...]}``; each request
    gets its rewards and scores (its rewards where there are none)."""

    def __init__(self, score: Callable[[list[str], list[str], list[Any]], Any], batch_size: int,
                 max_wait_ms: float) -> None:
        self.score, self.batch_size, self.max_wait = score, batch_size, max_wait_ms / 1000
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.batches = 0

    async def submit(self, queries: list[str], prompts: list[str],
                     labels: list[Any]) -> tuple[list[float], list[float]]:
        item = _Pending(queries, prompts, labels, asyncio.get_running_loop().create_future())
        await self.queue.put(item)
        return await item.future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            size = len(items[0].queries)
            deadline = loop.time() + self.max_wait
            while size < self.batch_size:
                try:
                    item = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
                items.append(item)
                size += len(item.queries)
            queries = [q for it in items for q in it.queries]
            prompts = [p for it in items for p in it.prompts]
            labels = [lb for it in items for lb in it.labels]
            try:
                out = await loop.run_in_executor(None, self.score, queries, prompts, labels)
                rewards, scores = _rewards_and_scores(out, len(queries))
                self.batches += 1
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the error
                for it in items:
                    it.future.set_exception(exc)
                continue
            offset = 0
            for it in items:
                part = slice(offset, offset + len(it.queries))
                it.future.set_result((rewards[part], scores[part]))
                offset += len(it.queries)


def _rewards_and_scores(out: Any, n: int) -> tuple[list[float], list[float]]:
    """A scorer's rewards and scores as float lists of ``n`` (the rewards stand in for absent scores)."""
    def floats(values: Any) -> list[float]:
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        if len(values) != n:
            raise ValueError(f"the scorer returned {len(values)} values for {n} queries")
        return [float(v) if v is not None else 0.0 for v in values]

    if isinstance(out, dict):
        rewards = floats(out["rewards"])
        return rewards, rewards if out.get("scores") is None else floats(out["scores"])
    rewards = floats(out)
    return rewards, rewards


def model_scorer(path: str, dtype: str, batch_size: int, normalize: bool = False) -> Callable[..., list[float]]:
    """Scores full query texts with a reward model (its own tokenizer; EOS appended); ``normalize``
    applies its stored mean / std."""
    from ..models.reward_model import RewardModelScorer

    scorer = RewardModelScorer(path, dtype, batch_size, normalize=normalize)
    tok = scorer.tokenizer

    def score(queries: list[str], prompts: list[str], labels: list[Any]) -> list[float]:
        import torch

        rows = []
        for q in queries:
            ids = tok(q, add_special_tokens=False)["input_ids"] or [tok.eos_token_id]
            if tok.eos_token_id is not None and ids[-1] != tok.eos_token_id:
                ids.append(tok.eos_token_id)
            rows.append(ids)
        out: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(rows), batch_size):
                out += scorer.score_ids(rows[start : start + batch_size])
        return out

    return score


def function_scorer(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A reward function on the protocol's fields: TRL's signature gets the completion as the query
    after its prompt; an OpenRLHF ``reward_func`` gets the queries and prompts as they came (its
    ``{"rewards", "scores"}`` answered as they are)."""

    def score(queries: list[str], prompts: list[str], labels: list[Any]) -> Any:
        completions = [q[len(p):] if p and q.startswith(p) else q for q, p in zip(queries, prompts)]
        kwargs: dict[str, Any] = {"label": labels} if any(lb is not None for lb in labels) else {}
        if getattr(fn, "wants_queries", False):
            kwargs.update(queries=queries, prompt_texts=prompts)
        return fn(prompts=prompts, completions=completions, **kwargs)

    return score


def make_app(score: Callable[..., list[float]], batch_size: int = 16, max_wait_ms: float = 5.0) -> Any:
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, HTTPException

    batcher = Batcher(score, batch_size, max_wait_ms)

    @asynccontextmanager
    async def lifespan(app: Any):
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    app = FastAPI(title="rlhf-plugins reward server", lifespan=lifespan)
    app.state.batcher = batcher

    @app.post("/get_reward")
    async def get_reward(request: RewardRequest) -> dict[str, Any]:
        n = len(request.query)
        prompts = request.prompts or [""] * n
        labels = request.labels or [None] * n
        if len(prompts) != n or len(labels) != n:
            raise HTTPException(422, f"'prompts' and 'labels' must have one entry per query ({n})")
        try:
            rewards, scores = await batcher.submit(request.query, prompts, labels)
        except Exception as exc:  # noqa: BLE001 - the client sees what went wrong
            raise HTTPException(500, f"{type(exc).__name__}: {exc}") from exc
        # extra_logs is logged by OpenRLHF's client as metrics of the user's run: nothing of ours in it
        return {"rewards": rewards, "scores": scores, "extra_logs": {}}

    @app.get("/stats")
    async def stats() -> dict[str, int]:
        """The server's own bookkeeping: model calls made so far."""
        return {"batches": batcher.batches}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
