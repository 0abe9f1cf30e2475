"""One trajectory's environment, whichever shape its class has.

* :class:`ToolSession` -- TRL's shape: public methods are tools, ``reset(**row)`` returns ``None``
  or text appended to the last user message, ``get_reward()`` (optional) scores the trajectory.
  Also runs standalone tools (``tools=[...]``) with no environment object at all.
* :class:`AgentSession` -- OpenRLHF's ``AgentInstance``: async ``reset(states)`` gives the prompt
  text, async ``step(states)`` answers each model turn with feedback text, a reward and ``done``.

Both give the driver the same three calls: ``start`` (prompt token ids), ``step`` (the tokens that
follow a model turn, and whether the trajectory is over) and ``reward``.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import EnvironmentFailed
from .tools import Renderer, call_tool, parse_turn, public_methods, tool_message


@dataclass
class StepResult:
    #: tokens after the model turn (environment output, tokenized once; never trained on)
    ids: list[int] = field(default_factory=list)
    #: the trajectory is over, and why ("stop": the model called no tool, "env_done": the environment said so)
    done: bool = False
    reason: str | None = None


@dataclass
class SessionContext:
    """What every session of a rollout shares."""

    tokenizer: Any
    renderer: Renderer | None
    #: runs a synchronous callable off the event loop: ``await run_sync(fn, *args, **kwargs)``
    run_sync: Callable[..., Any]
    #: apply the chat template to prompts (``--data.apply_chat_template``)
    chat: bool = True
    #: extra keyword arguments of the chat template (``--data.chat_template_kwargs``)
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def is_agent(instance: Any) -> bool:
    """OpenRLHF's shape: an async ``step``."""
    return is_agent_class(type(instance))


def is_agent_class(cls: type) -> bool:
    """A class of OpenRLHF's shape (told without building one: its ``__init__`` may be async)."""
    return inspect.iscoroutinefunction(getattr(cls, "step", None))


async def new_agent(factory: Callable[[], Any]) -> Any:
    """One OpenRLHF agent, built as OpenRLHF builds one per trajectory (the class called with no
    arguments). OpenRLHF's own example declares ``async def __init__``, which a plain call refuses
    ("__init__() should return None"): such an initialiser is awaited here, on the run's event loop."""
    if isinstance(factory, type) and inspect.iscoroutinefunction(factory.__init__):
        instance = factory.__new__(factory)
        await instance.__init__()
        return instance
    return await _maybe_await(factory())


def check_shape(name: str, instance: Any) -> None:
    """A one-line error for an environment object of neither shape (checked on a probe instance)."""
    if is_agent(instance):
        return
    if not callable(getattr(instance, "reset", None)):
        raise EnvironmentFailed(
            f"environment '{name}' ({type(instance).__name__}) has no reset(); a TRL environment defines reset(**row) "
            "and its tools as public methods, an OpenRLHF agent async reset(states) and async step(states)"
        )


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class _Session:
    def __init__(self, env: str, instance: Any, ctx: SessionContext, row: dict[str, Any], where: str) -> None:
        self.env, self.instance, self.ctx, self.row, self.where = env, instance, ctx, row, where
        self.tool_calls = self.tool_failures = 0
        #: the trajectory as messages (model turns and what answered them), for reward functions
        self.messages: list[dict[str, Any]] = []

    def fail(self, what: str, exc: BaseException | None = None) -> EnvironmentFailed:
        text = str(exc).strip() if exc else ""
        detail = f": {type(exc).__name__}: {text.splitlines()[0] if text else ''}" if exc else ""
        return EnvironmentFailed(f"environment '{self.env}' {what} ({self.where}){detail}".rstrip(": "))

    def render_prompt(self, prompt: Any, extra: str | None, tools: list[Any] | None) -> str:
        tok = self.ctx.tokenizer
        if not self.ctx.chat:
            return (prompt if isinstance(prompt, str) else "") + (extra or "")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if extra:
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + extra}
        return tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False,
                                       **self.ctx.template_kwargs)

    def encode(self, text: str) -> list[int]:
        if self.ctx.renderer is not None:
            return self.ctx.renderer.prompt_ids(text)
        return self.ctx.tokenizer(text, add_special_tokens=False)["input_ids"]


class ToolSession(_Session):
    """A TRL environment instance (or ``None``) plus standalone tools."""

    def __init__(self, env: str, instance: Any, tools: list[Callable[..., Any]], ctx: SessionContext,
                 row: dict[str, Any], where: str) -> None:
        super().__init__(env, instance, ctx, row, where)
        self.tools = list(tools) + (public_methods(instance) if instance is not None else [])
        self.table = {fn.__name__: fn for fn in self.tools}
        self.prefix = ""

    async def start(self, prompt: Any, reset_row: dict[str, Any]) -> list[int]:
        extra = None
        if self.instance is not None:
            try:
                extra = await _maybe_await(self.instance.reset(**reset_row))  # a reset is quick: run it here
            except Exception as exc:
                raise self.fail("failed in reset()", exc) from exc
            if extra is not None and not isinstance(extra, str):
                raise self.fail(f"reset() returned {type(extra).__name__}; return None or a string to append to the "
                                "prompt")
        text = self.render_prompt(prompt, extra, self.tools)
        self.prefix = text[-64:]
        return self.encode(text)

    async def step(self, turn_text: str) -> StepResult:
        content, calls = parse_turn(self.ctx.tokenizer, turn_text, self.prefix)
        calls = calls if self.table else []
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in calls if c.error is None]
        self.messages.append(message)
        if not calls:
            return StepResult(done=True, reason="stop")
        replies = []
        for call in calls:
            result, failed = await call_tool(self.table, call, self.ctx.run_sync)
            self.tool_calls += 1
            self.tool_failures += int(failed)
            replies.append(tool_message(call.name, result))
        self.messages.extend(replies)
        assert self.ctx.renderer is not None
        return StepResult(ids=self.ctx.renderer.suffix_ids(replies))

    async def reward(self) -> float | None:
        get = getattr(self.instance, "get_reward", None)
        if not callable(get):
            return None
        try:
            value = await _maybe_await(get())
        except Exception as exc:
            raise self.fail("failed in get_reward()", exc) from exc
        return _number(self, value, "get_reward()")


class AgentSession(_Session):
    """An OpenRLHF ``AgentInstance``: a new one per trajectory (as OpenRLHF's executor makes, so state
    its ``__init__`` sets starts afresh), the prompt from ``reset``, feedback from ``step``."""

    def __init__(self, env: str, factory: Callable[[], Any], ctx: SessionContext, row: dict[str, Any],
                 where: str) -> None:
        super().__init__(env, None, ctx, row, where)
        self.factory = factory
        self.observation = ""
        self.total = 0.0
        #: the last step's ``extra_logs`` (OpenRLHF logs them as metrics)
        self.extra_logs: Any = None
        #: the last step's ``scores`` (else the rewards so far): what dynamic filtering compares, as in OpenRLHF
        self.score: float | None = None
        #: the run's sampling settings, those of the model turn just sampled (the runner sets both), and
        #: what the step's returned ``sampling_params`` change for the next turns (our field names)
        self.run_params: Any = None
        self.turn_params: Any = None
        self.overrides: dict[str, Any] = {}

    async def start(self, prompt: Any, reset_row: dict[str, Any]) -> list[int]:
        try:
            self.instance = await new_agent(self.factory)
        except Exception as exc:
            raise self.fail("failed in __init__()", exc) from exc
        states = {"observation": self.render_prompt(prompt, None, None), "label": self.row.get("label", "")}
        try:
            out = await _maybe_await(self.instance.reset(states))
        except Exception as exc:
            raise self.fail("failed in reset()", exc) from exc
        if not isinstance(out, dict) or not isinstance(out.get("observation"), str):
            raise self.fail(f"reset() returned {type(out).__name__}; an agent returns {{'observation': str, ...}}")
        self.observation = out["observation"]
        return self.encode(self.observation)

    async def step(self, turn_text: str) -> StepResult:
        from .openrlhf import AgentSamplingParams

        shown = None if self.turn_params is None else AgentSamplingParams.of(self.turn_params)
        states = {"observation_text": self.observation, "action_text": turn_text, "label": self.row.get("label", ""),
                  "sampling_params": shown}
        try:
            out = await _maybe_await(self.instance.step(states))
        except Exception as exc:
            raise self.fail("failed in step()", exc) from exc
        if not isinstance(out, dict) or "environment_feedback" not in out or "done" not in out:
            keys = ", ".join(map(str, out)) if isinstance(out, dict) else type(out).__name__
            raise self.fail(f"step() returned {keys}; an agent returns a dict with rewards, environment_feedback and "
                            "done")
        feedback = out["environment_feedback"]
        if not isinstance(feedback, str):
            raise self.fail(f"step() returned environment_feedback of type {type(feedback).__name__}; return a string")
        self.total += _number(self, out.get("rewards", 0.0), "step()['rewards']")
        given = out.get("scores")
        self.score = self.total if given is None else _number(self, given, "step()['scores']")
        self.extra_logs = out.get("extra_logs")
        self.take_sampling_params(out.get("sampling_params"))
        self.observation += turn_text + feedback
        self.messages.append({"role": "assistant", "content": parse_turn(self.ctx.tokenizer, turn_text)[0]})
        if feedback:
            self.messages.append({"role": "environment", "content": feedback})
        done = bool(out["done"])
        return StepResult(ids=self.encode(feedback) if feedback else [], done=done, reason="env_done" if done else None)

    async def reward(self) -> float | None:
        return self.total

    def take_sampling_params(self, returned: Any) -> None:
        """OpenRLHF samples a trajectory's next turns with the ``sampling_params`` its step returns:
        here too, for what may change per turn (stop strings, top-p / top-k / min-p, the repetition
        penalty); None keeps the current ones."""
        if returned is None or self.run_params is None:
            return
        from .openrlhf import turn_overrides

        try:
            self.overrides = turn_overrides(returned, self.run_params)
        except (ValueError, TypeError) as exc:
            raise self.fail(f"step() {exc}") from None


def _number(session: _Session, value: Any, what: str) -> float:
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "numel", lambda: 1)() == 1:
        value = item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise session.fail(f"{what} returned {type(value).__name__} {str(value)[:40]!r}; return a finite number")
    return float(value)
