"""TRL's multi-turn arguments on our loop: ``GRPOTrainer(tools=..., environment_factory=...,
rollout_func=...)``.

* ``tools=[f, ...]`` -- standalone tools: one environment ``trl_tools`` with no object of its own.
* ``environment_factory=Factory`` -- one environment ``trl_env`` (its public methods are tools,
  ``reset(**row)``, optional ``get_reward()``), the standalone tools beside it.
* ``environment_factory={"name": Factory, ...}`` -- one environment per name; each row picks its
  own in its ``environment`` column (TRL's dict form).
* ``rollout_func(prompts, trainer)`` -- takes over generation through the ``rlhf_rollout`` hook;
  ``trainer`` is a :class:`RolloutTrainer` (TRL's attributes a rollout function reads, ``generate`` on
  the run's engine, and ``vllm_generation`` for functions written against TRL's vLLM helper).

An environment that defines ``get_reward`` adds the ``env_reward`` reward source (weight 1), as TRL
adds it; with no ``reward_funcs`` it is the only one.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..errors import ConfigError
from ..protocols import SamplingParams
from ..types import _NAME, Environment


class RolloutTrainer:
    """What a TRL ``rollout_func(prompts, trainer)`` sees as ``trainer``."""

    def __init__(self, args: Any, num_generations: int) -> None:
        self.args, self.num_generations = args, num_generations
        self.processing_class: Any = None
        self.engine: Any = None
        self.max_completion_length = getattr(args, "max_completion_length", None) or 256
        self.vllm_generation = EngineGeneration(self)

    def generate(self, prompt_ids: list[list[int]], n: int = 1, max_new_tokens: int | None = None,
                 temperature: float | None = None, seed: int | None = None) -> Any:
        """``n`` samples per prompt from the run's engine (current weights): a :class:`~rlhf_plugins.Samples`."""
        t = getattr(self.args, "temperature", 1.0) if temperature is None else temperature
        params = SamplingParams(n=n, max_new_tokens=max_new_tokens or self.max_completion_length, temperature=t,
                                seed=seed)
        return self.engine.generate(prompt_ids, params)


class EngineGeneration:
    """``trainer.vllm_generation`` for a rollout function written against TRL's vLLM helper
    (``trl.generation.VLLMGeneration``), on the run's engine, whichever it is: ``generate(prompts,
    images, num_generations)`` samples one completion per entry of ``prompts`` -- TRL passes each
    prompt's ids ``num_generations`` times in a row, and a group of equal prompts is one request of
    ``num_generations`` samples -- and returns TRL's tuple: the prompt ids, the completion ids, each
    token's log-prob and its token id (lists of one, as TRL's with ``logprobs=0``). ``sync_weights`` does
    nothing: the run's loop syncs the engine before each rollout."""

    def __init__(self, trainer: RolloutTrainer) -> None:
        self.trainer = trainer

    def sync_weights(self) -> None:
        pass

    def generate(self, prompts: list[list[int]], images: list[Any] | None = None, num_generations: int = 1,
                 profiler: Any = None) -> tuple[list[list[int]], list[list[int]], list[Any], list[Any]]:
        if images is not None and any(image is not None for image in images):
            raise ValueError("trainer.vllm_generation.generate: images are not supported here (text models only); "
                             "pass images=None")
        n = max(1, int(num_generations))
        prompts = [list(map(int, p)) for p in prompts]
        grouped = n > 1 and len(prompts) % n == 0 and all(prompts[i] == prompts[i - i % n] for i in range(len(prompts)))
        samples = self.trainer.generate(prompts[::n], n=n) if grouped else self.trainer.generate(prompts)
        completions = [list(c) for c in samples.completion_ids]
        logprobs = [[[float(lp)] for lp in row] for row in samples.logprobs]
        return prompts, completions, logprobs, [[[t] for t in c] for c in completions]


class TRLRollouts:
    """A plugin made of TRL's ``tools``, ``environment_factory`` and ``rollout_func`` (registered inline)."""

    def __init__(self, tools: list[Callable[..., Any]] | None, environment_factory: Any,
                 rollout_func: Callable[..., Any] | None, trainer: RolloutTrainer) -> None:
        self.tools = tuple(tools or ())
        if environment_factory is None:
            self.factories: dict[str, Callable[[], Any]] = {"trl_tools": _no_environment} if self.tools else {}
        elif isinstance(environment_factory, dict):
            self.factories = dict(environment_factory)
            for name in self.factories:
                if not isinstance(name, str) or not _NAME.match(name):
                    raise ConfigError(f"environment_factory key {name!r} cannot name an environment here: use "
                                      "lowercase letters, digits, '_' or '-', starting with a letter")
        else:
            self.factories = {"trl_env": environment_factory}
        for name, factory in self.factories.items():
            if not callable(factory):
                raise ConfigError(f"environment_factory {name!r} is {type(factory).__name__}; give a class or a "
                                  "callable returning an environment")
        self.multi = isinstance(environment_factory, dict)
        self.rollout_func, self.trainer = rollout_func, trainer

    def config(self) -> dict[str, Any]:
        """Our config for these environments: one for every row, or a row's ``environment`` column."""
        if not self.factories:
            return {}
        return {"env": {"column": "environment"}} if self.multi else {"env": {"name": next(iter(self.factories))}}

    def owns_reward(self) -> bool:
        """Whether an environment defines ``get_reward`` (probed on one instance, as TRL does)."""
        return any(callable(getattr(f(), "get_reward", None)) for f in self.factories.values()
                   if f is not _no_environment)

    def rlhf_environments(self) -> Iterable[Environment]:
        for name, factory in self.factories.items():
            yield Environment(name, factory=factory, tools=self.tools, description="TRL environment_factory")

    def rlhf_rollout(self, prompts: list[Any], rows: list[dict[str, Any]], params: Any, engine: Any,
                     tokenizer: Any) -> dict[str, Any] | None:
        if self.rollout_func is None:
            return None
        self.trainer.engine, self.trainer.processing_class = engine, tokenizer
        self.trainer.num_generations = params.n
        return self.rollout_func(prompts, self.trainer)


def _no_environment() -> None:
    """Standalone tools alone: no environment object."""
    return None
