"""A callable named by ``"module:attr"``, imported on first use.

Builtin registration modules hand these to the component dataclasses so that
``rlhf plugins`` lists every component without importing torch. Before the first
step the loop resolves them to the plain function (:func:`resolve`), so the hot
path pays nothing. They pickle as their target string, so Ray workers import the
function themselves.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class Lazy:
    __slots__ = ("target", "_fn")

    def __init__(self, target: str) -> None:
        if ":" not in target:
            raise ValueError(f"lazy target must look like 'module:attr', got {target!r}")
        self.target = target
        self._fn: Callable[..., Any] | None = None

    def resolve(self) -> Callable[..., Any]:
        if self._fn is None:
            module, attr = self.target.split(":")
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
            self._fn = obj
        return self._fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __reduce__(self):
        return (Lazy, (self.target,))

    def __repr__(self) -> str:
        return f"Lazy({self.target!r})"


def resolve(obj: Any) -> Any:
    """The plain callable behind ``obj`` (itself when it is not lazy)."""
    return obj.resolve() if isinstance(obj, Lazy) else obj
