"""OpenRLHF agent files, loaded unchanged with ``--plugin agent_func.py``.

An OpenRLHF agent file defines ``class AgentInstance(AgentInstanceBase)`` with async
``reset(states)`` and ``step(states)`` (``from openrlhf.utils.agent import AgentInstanceBase``).
Loaded as a plugin, such a file registers one environment named after the file (``agent_func``
for ``agent_func.py``) whose factory is its ``AgentInstance``; a run that loads exactly one
plugin environment uses it without ``--env.name``.

OpenRLHF itself need not be installed: when it is not, the file's ``openrlhf.utils.agent`` import
resolves to the base classes below (same names, same methods), and only for that import.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from abc import ABC, abstractmethod
from collections.abc import Iterable
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


def provide_agent_module(source: str) -> None:
    """Before importing a plugin file: make ``openrlhf.utils.agent`` importable when the file uses it
    and OpenRLHF is not installed."""
    if AGENT_MODULE not in source or AGENT_MODULE in sys.modules:
        return
    try:
        if importlib.util.find_spec("openrlhf") is not None:
            return
    except (ImportError, ValueError):
        pass
    parts = AGENT_MODULE.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        module = sys.modules.setdefault(name, types.ModuleType(name))
        if i < len(parts):
            module.__path__ = []  # a package, so the next part imports
    agent = sys.modules[AGENT_MODULE]
    agent.AgentInstanceBase, agent.AgentExecutorBase = AgentInstanceBase, AgentExecutorBase


class AgentFile:
    """The plugin made of an OpenRLHF agent file: its ``AgentInstance`` as an environment."""

    def __init__(self, name: str, cls: type) -> None:
        self.name, self.cls = name, cls

    @classmethod
    def of_module(cls, module: Any, name: str) -> AgentFile | None:
        agent = getattr(module, "AgentInstance", None)
        if not isinstance(agent, type):
            return None
        from ..rewards.callables import component_name

        return cls(component_name(name), agent)

    def rlhf_environments(self) -> Iterable[Any]:
        from ..types import Environment

        doc = (self.cls.__doc__ or "an OpenRLHF agent").strip().splitlines()[0]
        yield Environment(self.name, factory=self.cls, description=doc)
