"""OpenRLHF agent files, loaded unchanged with ``--plugin agent_func.py``.

An OpenRLHF agent file defines ``class AgentInstance(AgentInstanceBase)`` with async
``reset(states)`` and ``step(states)`` (``from openrlhf.utils.agent import AgentInstanceBase``), and
in OpenRLHF's current form also ``class AgentExecutor(MultiTurnAgentExecutor)`` whose ``__init__``
names the agent class (``super().__init__(AgentInstance)``, any class name). Loaded as a plugin, such
a file registers one environment named after the file (``agent_func`` for ``agent_func.py``) whose
factory is that agent class; a run that loads exactly one plugin environment uses it without
``--env.name``.

OpenRLHF itself need not be installed: when it is not, the file's ``openrlhf.utils.agent`` import
finds the stand-in modules of :mod:`rlhf_plugins.compat.openrlhf` (the base classes below, same names
and methods), and only while the file is imported.
"""
from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AGENT_MODULE = "openrlhf.utils.agent"


class AgentInstanceBase(ABC):
    """OpenRLHF's agent base: one instance per trajectory."""

    @abstractmethod
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs: Any) -> dict:
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase(ABC):
    """OpenRLHF's executor base, for files that subclass it; rlhf-plugins runs the turns itself."""

    @abstractmethod
    async def execute(self, prompt: Any, label: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any,
                      llm_engine: Any) -> dict:
        raise NotImplementedError


@dataclass
class AgentSamplingParams:
    """What an agent's ``step`` gets as ``states["sampling_params"]``: the turn's sampling settings under
    vLLM's ``SamplingParams`` names, as OpenRLHF hands its agents (``max_tokens``: the trajectory's
    budget for the turn). A ``sampling_params`` the step returns sets the trajectory's next turns:
    see :func:`turn_overrides`."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    logprobs: int = 1

    def clone(self) -> AgentSamplingParams:
        """A copy, as vLLM's ``SamplingParams.clone()``."""
        return dataclasses.replace(self, stop=list(self.stop))

    @classmethod
    def of(cls, params: Any) -> AgentSamplingParams:
        """From the engine's :class:`~rlhf_plugins.protocols.SamplingParams` of the turn."""
        return cls(params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty,
                   params.max_new_tokens, list(params.stop), params.seed)


#: fields a step's returned ``sampling_params`` may change for the trajectory's next turns (vLLM's name:
#: ours); the temperature may not (the learner's log-probs assume the run's), max_tokens is the budget
TURN_FIELDS = {"top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
               "stop": "stop"}


def turn_overrides(returned: Any, run: Any) -> dict[str, Any]:
    """What a ``sampling_params`` returned by an agent's step changes against the run's settings
    (``run``: :class:`~rlhf_plugins.protocols.SamplingParams`), as our field names; a vLLM
    ``SamplingParams``, this class or a dict. Raises ValueError for a changed temperature."""
    get = returned.get if isinstance(returned, dict) else (lambda name, default=None: getattr(returned, name, default))
    temperature = get("temperature", run.temperature)
    if temperature is not None and abs(float(temperature) - run.temperature) > 1e-9:
        raise ValueError(f"returned sampling_params with temperature {temperature} for the next turn; the learner's "
                         f"log-probs assume the run's --generation.temperature {run.temperature:g} on every turn "
                         "(set that instead)")
    out: dict[str, Any] = {}
    for theirs, ours in TURN_FIELDS.items():
        value = get(theirs, None)
        if value is None:
            continue
        if ours == "stop":
            value = tuple(x for x in ((value,) if isinstance(value, str) else value) if x)  # "" stops nothing
        elif ours == "top_k":
            value = max(int(value), 0)  # vLLM's -1 is our 0: off
        if value != getattr(run, ours):
            out[ours] = value
    return out


class MultiTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF's multi-turn executor as agent files subclass it (``class AgentExecutor(MultiTurnAgentExecutor)``
    calling ``super().__init__(AgentInstance)``): here it names the file's agent class, and rlhf-plugins
    runs the turns itself."""

    def __init__(self, agent_instance_cls: type) -> None:
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError("AgentInstance must inherit from AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt: Any, label: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any,
                      llm_engine: Any) -> dict:
        raise NotImplementedError("rlhf-plugins runs an agent's turns itself (rlhf_plugins.environments.runner)")


class _CompatFinder(importlib.abc.MetaPathFinder):
    """Finds ``openrlhf`` and its submodules in :mod:`rlhf_plugins.compat.openrlhf` (real files)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "openrlhf" and not fullname.startswith("openrlhf."):
            return None
        base = Path(__file__).resolve().parent.parent / "compat"
        parts = fullname.split(".")
        folder = base.joinpath(*parts)
        if (folder / "__init__.py").is_file():
            return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])
        file = base.joinpath(*parts[:-1], parts[-1] + ".py")
        return importlib.util.spec_from_file_location(fullname, file) if file.is_file() else None


@contextmanager
def agent_imports(source: str) -> Iterator[None]:
    """While a plugin file is imported: when it uses ``openrlhf.utils.agent`` and OpenRLHF is not
    installed, that import finds the real stand-in modules of :mod:`rlhf_plugins.compat.openrlhf`;
    afterwards nothing named ``openrlhf`` is left behind (the file holds the classes it imported)."""
    try:
        needed = AGENT_MODULE in source and importlib.util.find_spec("openrlhf") is None
    except (ImportError, ValueError):
        needed = False
    if not needed:
        yield
        return
    finder = _CompatFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "openrlhf" or n.startswith("openrlhf.")]:
            del sys.modules[name]


class AgentFile:
    """The plugin made of an OpenRLHF agent file: its ``AgentInstance`` as an environment."""

    def __init__(self, name: str, cls: type) -> None:
        self.name, self.cls = name, cls

    @classmethod
    def of_module(cls, module: Any, name: str) -> AgentFile | None:
        agent = agent_class(module)
        if agent is None:
            if isinstance(getattr(module, "AgentExecutor", None), type):
                from ..errors import PluginError

                raise PluginError(f"plugin '{name}' defines an OpenRLHF AgentExecutor that names no agent class "
                                  "(its own execute() loop); rlhf-plugins runs the turns itself: define the "
                                  "AgentInstance (async reset / step) that OpenRLHF's MultiTurnAgentExecutor takes")
            return None
        from ..rewards.callables import component_name

        return cls(component_name(name), agent)

    def rlhf_environments(self) -> Iterable[Any]:
        from ..types import Environment

        doc = (self.cls.__doc__ or "an OpenRLHF agent").strip().splitlines()[0]
        yield Environment(self.name, factory=self.cls, description=doc)


def agent_class(module: Any) -> type | None:
    """A file's agent class: the one its ``AgentExecutor`` names (OpenRLHF's current
    ``class AgentExecutor(MultiTurnAgentExecutor)``, built with no arguments as OpenRLHF builds it),
    else its ``AgentInstance`` (older executors take ``(max_length, llm_engine, hf_tokenizer)``)."""
    executor = getattr(module, "AgentExecutor", None)
    if isinstance(executor, type):
        try:
            named = getattr(executor(), "agent_instance_cls", None)
        except TypeError:
            named = None
        if isinstance(named, type):
            return named
    agent = getattr(module, "AgentInstance", None)
    return agent if isinstance(agent, type) else None
