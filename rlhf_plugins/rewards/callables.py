"""Reward callables from other ecosystems, used unchanged, and modules of plain reward functions.

* TRL: ``func(prompts, completions, **kwargs) -> list[float | None]`` (sync or
  async); ``kwargs`` holds ``completion_ids`` and every dataset column.
* OpenRLHF: ``reward_func(queries, prompts, labels)`` returning a tensor, a list,
  or a dict with ``"rewards"`` (and ``"scores"``, ``"extra_logs"``); ``queries`` are prompt +
  completion texts.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

from ..types import RewardFunction


def _params(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def is_openrlhf_style(fn: Callable[..., Any]) -> bool:
    return {"queries", "prompts", "labels"} <= set(_params(fn))


def looks_like_reward(fn: Callable[..., Any]) -> bool:
    """TRL's ``(prompts, completions, **kwargs)`` (``completions`` is what matters) or OpenRLHF's triple."""
    return "completions" in _params(fn) or is_openrlhf_style(fn)


def component_name(name: str) -> str:
    return re.sub(r"[^a-z0-9_\-]", "_", name.lower()).lstrip("_-0123456789") or "reward"


def unwrapped(fn: Callable[..., Any]) -> Any:
    """The function a ``functools.partial`` (nested or not) wraps; anything else as it is."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def callable_name(fn: Callable[..., Any]) -> str:
    """A reward callable's name as TRL gives it: a function's own, a partial's wrapped function's, a callable
    instance's class name."""
    inner = unwrapped(fn)
    return getattr(inner, "__name__", type(inner).__name__)


class TRLReward:
    """Calls a TRL-style function with the keyword arguments it accepts."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        params = _params(fn)
        self.accepts_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.accepted = set(params)
        self.is_async = inspect.iscoroutinefunction(fn)

    def __call__(self, **kwargs: Any) -> Any:
        prompts = kwargs.get("prompts")
        if prompts and isinstance(prompts[0], list):  # conversational data: TRL passes messages
            turns = kwargs.get("trajectory")  # multi-turn: every turn, tool replies included
            kwargs["completions"] = ([list(t) for t in turns] if turns is not None
                                     else [[{"role": "assistant", "content": c}] for c in kwargs["completions"]])
        if not self.accepts_all:
            kwargs = {k: v for k, v in kwargs.items() if k in self.accepted}
        out = self.fn(**kwargs)
        if self.is_async or inspect.isawaitable(out):
            out = _run(out)
        return out


class OpenRLHFReward:
    """Adapts ``reward_func(queries, prompts, labels)`` as OpenRLHF calls it: ``prompts`` as the policy
    saw them (chat template included), ``queries`` the prompt and completion tokens decoded together
    (special tokens kept). A returned dict's ``extra_logs`` become metrics (their batch means), as
    OpenRLHF logs them; its ``rewards`` train and its ``scores`` are what dynamic filtering compares
    (the reward role reads both)."""

    #: the reward role passes the rendered texts (``queries``, ``prompt_texts``)
    wants_queries = True

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *, prompts: list[Any], completions: list[str], queries: list[str] | None = None,
                 prompt_texts: list[str] | None = None, **kwargs: Any) -> Any:
        if prompt_texts is None or queries is None:  # called without the rendered texts: the raw ones
            prompt_texts = [p if isinstance(p, str) else str(p) for p in prompts]
            queries = [p + c for p, c in zip(prompt_texts, completions)]
        labels = kwargs.get("label")  # OpenRLHF's labels are "" without a label key
        out = self.fn(queries=queries, prompts=prompt_texts, labels=[""] * len(queries) if labels is None else labels)
        if inspect.isawaitable(out):
            out = _run(out)
        if isinstance(out, dict):
            log_extra(out.get("extra_logs"), kwargs.get("log_metric"))
            rewards = out["rewards"] if out.get("rewards") is not None else out.get("scores")
            out = {"rewards": rewards, "scores": out.get("scores")}
        return out


def log_extra(extra: Any, log_metric: Callable[[str, float], None] | None) -> None:
    """OpenRLHF's ``extra_logs`` (name -> a number, or one per sample) as metrics: each one's mean."""
    if not isinstance(extra, dict) or log_metric is None:
        return
    for name, value in extra.items():
        values = value.flatten().tolist() if hasattr(value, "flatten") else value
        values = [values] if isinstance(values, (int, float)) else list(values or [])
        numbers = [float(v) for v in values if isinstance(v, (int, float))]
        if numbers:
            log_metric(str(name), sum(numbers) / len(numbers))


def _run(awaitable: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(awaitable)
    raise RuntimeError("an async reward function cannot be awaited inside a running event loop")


def wrap_reward(fn: Callable[..., Any]) -> Callable[..., Any]:
    return OpenRLHFReward(fn) if is_openrlhf_style(fn) else TRLReward(fn)


#: modules of other packages' reward functions that need a package they import only where it is
#: installed (TRL's answer checkers call math-verify), with the rlhf-plugins extra that installs it
NEEDS = {"trl.rewards.accuracy_rewards": ("math_verify", "math")}


def as_reward_function(fn: Callable[..., Any], name: str | None = None) -> RewardFunction:
    inner = unwrapped(fn)  # a partial's name, docstring and module are its function's
    doc = (inspect.getdoc(inner) or "").splitlines()
    module, extra = NEEDS.get(getattr(inner, "__module__", None) or "", (None, None))
    return RewardFunction(component_name(name or callable_name(fn)), wrap_reward(fn), description=doc[0] if doc else "",
                          requires=(module,) if module else (), extra=extra)


class FunctionRewards:
    """The simplest plugin: a module of plain reward functions with TRL's signature
    ``(prompts, completions, **kwargs)`` and no hooks, registered as it is."""

    def __init__(self, module: Any, functions: list[Callable[..., Any]]) -> None:
        self.module = module
        self.functions = functions

    @classmethod
    def of_module(cls, module: Any) -> FunctionRewards | None:
        functions = [
            value for attr, value in vars(module).items()
            if not attr.startswith("_") and inspect.isfunction(value)
            and getattr(value, "__module__", None) == module.__name__ and looks_like_reward(value)
        ]
        return cls(module, functions) if functions else None

    def rlhf_reward_functions(self) -> Any:
        for fn in self.functions:
            yield as_reward_function(fn)
