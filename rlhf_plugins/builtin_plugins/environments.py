"""Builtin environment: a calculator for the embedded tool-calling model, and the ``env_reward``
reward function (an environment's own reward as a reward source)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._markers import hookimpl
from ..types import Environment, RewardFunction


class Calculator:
    """Two-digit sums with a calculator tool: the tiny model cannot add them in its head."""

    def reset(self, **row: Any) -> None:
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate a sum or difference of whole numbers.

        Args:
            expression: numbers joined by + or -, e.g. "47+38"
        """
        from ..models.tool_model import calculator

        return calculator(expression)


def _tool_model() -> str:
    from ..models.tool_model import tool_model_path

    return tool_model_path()


def env_reward(prompts: list[Any], completions: list[str], env_reward: list[float | None] | None = None,
               env_score: list[float | None] | None = None, **kwargs: Any) -> Any:
    """The environment's own reward of each trajectory (get_reward, or an agent's summed rewards)."""
    if env_reward is None or all(v is None for v in env_reward):
        raise ValueError("env_reward reads the environment's own reward, and this run's environments give none "
                         "(no get_reward, not an agent); choose --reward.functions")
    if env_score is None:
        return list(env_reward)
    # an OpenRLHF agent's scores: what dynamic filtering compares (its rewards train)
    return {"rewards": list(env_reward), "scores": [r if s is None else s for r, s in zip(env_reward, env_score)]}


@hookimpl
def rlhf_environments() -> Iterable[Environment]:
    yield Environment("calculator", factory=Calculator, description=Calculator.__doc__,
                      default_data="builtin:calculator-train", default_model=_tool_model)


@hookimpl
def rlhf_reward_functions() -> Iterable[RewardFunction]:
    yield RewardFunction("env_reward", env_reward, description=env_reward.__doc__.splitlines()[0])
