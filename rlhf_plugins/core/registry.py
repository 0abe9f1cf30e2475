"""Components of every area, by name, with the plugin that provided each."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, PluginError
from ..types import AREAS, Component

#: what other frameworks call a builtin component: (area, their name) -> (ours, what theirs is), for the line
#: an unknown name gets (verl's estimator and loss names, torch's and vLLM's words for a backend or a sync)
ELSEWHERE: dict[tuple[str, str], tuple[str, str]] = {
    ("advantage estimator", "grpo"): ("group_norm", "verl's GRPO advantage"),
    ("advantage estimator", "reinforce_plus_plus"): ("reinforce", "verl's REINFORCE++ advantage"),
    ("advantage estimator", "reinforce_plus_plus_baseline"): ("reinforce_baseline",
                                                              "verl's REINFORCE++ with a group baseline"),
    ("policy loss", "vanilla"): ("ppo", "verl's vanilla clipped loss"),
    ("learner backend", "fsdp2"): ("fsdp", "torch's FSDP2"),
    ("generation backend", "hf"): ("transformers", "generation with transformers"),
    ("weight sync method", "nccl"): ("broadcast", "a NCCL broadcast"),
    ("weight sync method", "cuda_ipc"): ("ipc", "CUDA IPC"),
}


@dataclass
class ComponentRow:
    area: str
    name: str
    provider: str
    component: Component


def area_class(component: Component) -> type[Component]:
    for cls in AREAS.values():
        if isinstance(component, cls):
            return cls
    raise TypeError(f"{component!r} is not a component of any area")


class ComponentRegistry:
    """What the registration hooks yielded; the config picks from it by name."""

    def __init__(self) -> None:
        self._rows: dict[type[Component], dict[str, ComponentRow]] = {cls: {} for cls in AREAS.values()}

    def add(self, component: Component, provider: str) -> None:
        area = self._rows[area_class(component)]
        prev = area.get(component.name)
        if prev is not None:
            raise PluginError(
                f"{component.area} '{component.name}' is provided by both plugin '{prev.provider}' and "
                f"plugin '{provider}'; block one with --plugin no:{provider}"
            )
        area[component.name] = ComponentRow(component.area, component.name, provider, component)

    def names(self, cls: type[Component]) -> list[str]:
        return sorted(self._rows[cls])

    def row(self, cls: type[Component], name: str) -> ComponentRow:
        rows = self._rows[cls]
        if name not in rows:
            choices = ", ".join(sorted(rows)) or "(none registered)"
            ours, theirs = ELSEWHERE.get((cls.area, str(name).lower()), ("", ""))
            here = f" ({theirs} is '{ours}' here)" if ours in rows else ""
            raise ConfigError(f"unknown {cls.area} '{name}'{here}; choose one of: {choices}")
        return rows[name]

    def get(self, cls: type[Component], name: str, *, require_available: bool = True) -> Any:
        row = self.row(cls, name)
        comp = row.component
        if require_available and not comp.available:
            raise ConfigError(
                f"{cls.area} '{name}' (plugin '{row.provider}') needs {', '.join(comp.missing())}, "
                f"which is not installed: {comp.install_hint()}"
            )
        return comp

    def provider(self, cls: type[Component], name: str) -> str:
        return self.row(cls, name).provider

    def of(self, cls: type[Component]) -> list[ComponentRow]:
        return [self._rows[cls][n] for n in sorted(self._rows[cls])]

    def __iter__(self) -> Iterator[ComponentRow]:
        for cls in AREAS.values():
            yield from self.of(cls)
