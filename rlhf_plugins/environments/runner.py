"""The multi-turn rollout: generate -> read the turn -> step the environment -> append its output
-> generate again, for every trajectory of a step at once.

Each turn is one batched call to the generation engine (``n = 1`` per trajectory, the whole token
context so far as its prompt: vLLM's prefix cache reuses earlier turns). The model's tokens are
kept exactly as sampled, with their engine log-probs; the environment's output is tokenized once
and inserted with action mask 0. Environment calls (reset, tools, step, get_reward) of all
trajectories run concurrently on the run's event loop (synchronous tools on a thread pool).

A trajectory ends when the model calls no tool (``stop``), the environment says so (``env_done``),
after ``--env.max_turns`` model turns (``max_turns``), or when its tokens reach
``--env.max_total_tokens`` or a turn reaches ``--env.max_turn_tokens`` (``length``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable, Coroutine
from typing import Any

from ..backend_data import derived_seed
from ..errors import ConfigError
from ..protocols import SamplingParams
from .sessions import AgentSession, SessionContext, ToolSession, check_shape, is_agent, is_agent_class
from .tools import Renderer, run_in
from .trajectories import Trajectories


class EnvRunner:
    """Runs the multi-turn rollouts of a run: the environments by name (``{name: Environment}``),
    which environment each row uses, and instance pools of TRL environments (an instance is built
    once and reset for every trajectory it serves; an OpenRLHF agent is built for each one)."""

    def __init__(self, config: Any, tokenizer: Any, environments: dict[str, Any]) -> None:
        self.cfg, self.tokenizer = config.env, tokenizer
        self.chat = bool(config.data.apply_chat_template)
        template_kwargs = dict(config.data.chat_template_kwargs)
        self.envs = dict(environments)
        self.factories = {name: env.factory for name, env in self.envs.items()}
        self.pools: dict[str, list[Any]] = {}
        # one event loop for the run (an async environment may keep loop-bound resources between
        # steps), run in the calling thread for each batch of environment calls
        self.loop = asyncio.new_event_loop()
        self.executor = concurrent.futures.ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="rlhf-tool")
        self.renderer: Renderer | None = None
        #: OpenRLHF agents: a new instance per trajectory (TRL environments are pooled and reset)
        self.agents = {name for name in self.factories if self._is_agent(name)}
        if set(self.factories) - self.agents:
            try:
                self.renderer = Renderer(tokenizer, template_kwargs)
            except Exception as exc:
                raise ConfigError(f"the model's chat template cannot render tool calls and tool messages "
                                  f"({type(exc).__name__}: {exc}); multi-turn tool use needs a template "
                                  "that does") from exc
        self.ctx = SessionContext(tokenizer, self.renderer, run_in(self.executor), self.chat, template_kwargs)

    def _is_agent(self, name: str) -> bool:
        """Whether an environment is an OpenRLHF agent: told by its class (whose ``__init__`` may be
        async), else by a probe instance (checked for a known shape)."""
        factory = self.factories[name]
        return (isinstance(factory, type) and is_agent_class(factory)) or is_agent(self._probe(name))

    def _probe(self, name: str) -> Any:
        """One instance, checked for a known shape; it seeds the pool."""
        if not self.pools.get(name):
            instance = self.factories[name]()
            if instance is not None:
                check_shape(name, instance)
            self.pools[name] = [instance]
        return self.pools[name][0]

    def env_of(self, row: dict[str, Any]) -> str | None:
        name = row.get(self.cfg.column) or self.cfg.name
        if name is not None and name not in self.factories:
            raise ConfigError(f"unknown environment '{name}' (row column '{self.cfg.column}' or --env.name); "
                              f"choose one of: {', '.join(sorted(self.factories)) or 'none registered'}")
        return name

    def _instances(self, names: list[str | None]) -> list[Any]:
        """One pooled instance per trajectory (the pool grows when a step needs more)."""
        used: dict[str, int] = {}
        out = []
        for name in names:
            if name is None:
                out.append(None)
                continue
            k = used.get(name, 0)
            pool = self.pools.setdefault(name, [])
            while len(pool) <= k:
                pool.append(self.factories[name]())
            used[name] = k + 1
            out.append(pool[k])
        return out

    def _gather(self, coros: list[Coroutine[Any, Any, Any]]) -> list[Any]:
        async def run_all() -> list[Any]:
            limit = asyncio.Semaphore(self.cfg.concurrency)

            async def one(coro: Coroutine[Any, Any, Any]) -> Any:
                async with limit:
                    return await coro

            return await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)

        results = self.loop.run_until_complete(run_all())
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def run(self, generate: Callable[[list[list[int]], SamplingParams], Any], prompts: list[Any],
            rows: list[dict[str, Any]], where: list[str], params: SamplingParams) -> Trajectories:
        """``params.n`` trajectories for each prompt (``rows``: its dataset row; ``where``: how an
        error names it)."""
        n, cfg = params.n, self.cfg
        sessions = self._sessions(rows, where, n)
        reset_rows = [{k: v for k, v in rows[j // n].items() if k != cfg.column} for j in range(len(sessions))]
        out = Trajectories()
        out.prompt_ids = self._gather([s.start(prompts[j // n], reset_rows[j]) for j, s in enumerate(sessions)])
        B = len(sessions)
        out.completion_ids, out.action_masks, out.logprobs = ([[] for _ in range(B)] for _ in range(3))
        out.final_texts, out.turns, out.finish_reasons = [""] * B, [0] * B, [""] * B
        active = list(range(B))
        for turn in range(cfg.max_turns):
            room = {i: cfg.max_total_tokens - len(out.completion_ids[i]) for i in active}
            for i in [i for i in active if room[i] <= 0]:
                out.finish_reasons[i] = "length"
            active = [i for i in active if room[i] > 0]
            if not active:
                break
            contexts = [out.prompt_ids[i] + out.completion_ids[i] for i in active]
            samples = self._sample(generate, contexts, params, turn, [room[i] for i in active], out,
                                   [sessions[i] for i in active])
            replies = self._model_turn(out, active, samples, contexts, room)
            active = self._env_turn(out, sessions, replies, turn)
        out.env_rewards = self._gather([s.reward() for s in sessions])
        out.messages = [s.messages for s in sessions]
        out.tool_calls = [s.tool_calls for s in sessions]
        out.tool_failures = [s.tool_failures for s in sessions]
        out.extra_logs = [getattr(s, "extra_logs", None) for s in sessions]
        out.env_scores = [getattr(s, "score", None) for s in sessions]
        return out

    def _sessions(self, rows: list[dict[str, Any]], where: list[str], n: int) -> list[Any]:
        """One session per trajectory: an agent's own, or the tool-calling loop of its environment."""
        names = [self.env_of(row) for row in rows for _ in range(n)]
        pooled = self._instances([None if name in self.agents else name for name in names])
        sessions: list[Any] = []
        for j, (name, inst) in enumerate(zip(names, pooled)):
            row, at = rows[j // n], where[j // n]
            if name in self.agents:
                sessions.append(AgentSession(name, self.factories[name], self.ctx, row, at))
            else:
                tools = list(self.envs[name].tools) if name is not None else []
                sessions.append(ToolSession(name or "none", inst, tools, self.ctx, row, at))
        return sessions

    def _sample(self, generate: Callable[..., Any], contexts: list[list[int]], params: SamplingParams, turn: int,
                rooms: list[int], out: Trajectories, sessions: list[Any]) -> Any:
        """One model turn of every active trajectory (``rooms``: each one's tokens left). Trajectories
        whose agent changed their sampling settings are sampled in calls of their own."""
        cfg, n = self.cfg, params.n
        seed = None if params.seed is None else params.seed + 7919 * turn
        cap = cfg.max_turn_tokens or cfg.max_total_tokens
        turn_params = dataclasses.replace(params, n=1, seed=seed, max_new_tokens=min(cap, max(rooms)))
        own = [dataclasses.replace(turn_params, max_new_tokens=min(cap, r), **getattr(s, "overrides", {}))
               for s, r in zip(sessions, rooms)]
        for s, p in zip(sessions, own):
            if isinstance(s, AgentSession):  # what its step is shown as sampling_params
                s.run_params, s.turn_params = params, p
        B = len(contexts)
        if turn == 0 and n > 1 and all(contexts[j] == contexts[j - j % n] for j in range(B)):
            # the first turn of a group starts from one prompt: sample its n turns in one request
            # (the engine prefills the prompt once)
            return generate(contexts[::n], dataclasses.replace(turn_params, n=n))
        samples = _by_settings(generate, contexts, turn_params, [getattr(s, "overrides", {}) for s in sessions])
        if turn > 0 and getattr(samples, "cached_prompt_tokens", None) is not None:
            out.later_cached_tokens = (out.later_cached_tokens or 0) + samples.cached_prompt_tokens
            out.later_prompt_tokens += sum(len(c) for c in contexts)
        return samples

    def _model_turn(self, out: Trajectories, active: list[int], samples: Any, contexts: list[list[int]],
                    room: dict[int, int]) -> list[tuple[int, str, str]]:
        """Append each trajectory's sampled tokens (trained on); the ones that go on to the
        environment, as (trajectory, the turn's text, the text just before it)."""
        tok, replies = self.tokenizer, []
        for j, i in enumerate(active):
            ids, lps = list(samples.completion_ids[j]), list(samples.logprobs[j])
            cut = len(ids) > room[i]
            ids, lps = ids[: room[i]], lps[: room[i]]
            out.completion_ids[i] += ids
            out.action_masks[i] += [1] * len(ids)
            out.logprobs[i] += lps
            out.turns[i] += 1
            out.final_texts[i] = tok.decode(ids, skip_special_tokens=True)
            if cut or samples.finish_reasons[j] == "length":
                out.finish_reasons[i] = "length"
                continue
            replies.append((i, tok.decode(ids, skip_special_tokens=False),
                            tok.decode(contexts[j][-16:], skip_special_tokens=False)))
        return replies

    def _env_turn(self, out: Trajectories, sessions: list[Any], replies: list[tuple[int, str, str]],
                  turn: int) -> list[int]:
        """Each environment answers its trajectory's turn; its tokens are appended (masked out of the
        loss). The trajectories still active."""
        cfg = self.cfg
        before = {i: len(sessions[i].messages) for i, _, _ in replies}
        results = self._gather([_step(sessions[i], text, prefix) for i, text, prefix in replies])
        active = []
        for (i, _, _), res in zip(replies, results):
            if res.done:
                out.finish_reasons[i] = res.reason or "stop"
            elif turn == cfg.max_turns - 1:  # out of turns: what answered the last turn is not kept
                out.finish_reasons[i] = "max_turns"
                del sessions[i].messages[before[i] + 1:]
            else:
                left = cfg.max_total_tokens - len(out.completion_ids[i])
                ids = res.ids[:left]
                out.completion_ids[i] += ids
                out.action_masks[i] += [0] * len(ids)
                out.logprobs[i] += [0.0] * len(ids)
                if len(res.ids) >= left:
                    out.finish_reasons[i] = "length"
                else:
                    active.append(i)
        return active

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if not self.loop.is_closed():
            self.loop.close()


def _by_settings(generate: Callable[..., Any], contexts: list[list[int]], params: SamplingParams,
                 overrides: list[dict[str, Any]]) -> Any:
    """``generate`` for every context, one call per distinct set of sampling overrides (one call when
    none has any), the samples back in the order of ``contexts``. Each call has a seed of its own (unless
    the overrides set one): an engine seeds a call's prompts by their place in it."""
    keys = [tuple(sorted(o.items())) for o in overrides]
    if len(set(keys)) <= 1:
        return generate(contexts, dataclasses.replace(params, **overrides[0]) if overrides else params)
    from ..protocols import Samples

    merged = Samples(list(range(len(contexts))), [[]] * len(contexts), [[]] * len(contexts), [""] * len(contexts))
    cached: int | None = 0
    for call, key in enumerate(dict.fromkeys(keys)):
        idx = [j for j, k in enumerate(keys) if k == key]
        seed = {} if params.seed is None else {"seed": derived_seed(params.seed, "settings", call)}
        part = generate([contexts[j] for j in idx], dataclasses.replace(params, **{**seed, **dict(key)}))
        for k, j in enumerate(idx):
            merged.completion_ids[j], merged.logprobs[j] = part.completion_ids[k], part.logprobs[k]
            merged.finish_reasons[j] = part.finish_reasons[k]
        got = getattr(part, "cached_prompt_tokens", None)
        cached = None if cached is None or got is None else cached + got
    merged.cached_prompt_tokens = cached
    return merged


async def _step(session: Any, text: str, prefix: str) -> Any:
    if isinstance(session, ToolSession):
        session.prefix = prefix
    return await session.step(text)
