"""Local placement: every role is an object in this process."""
from __future__ import annotations

from typing import Any

from ..protocols import PlacementContext


class LocalPlacement:
    """Roles are constructed in place (one rank each); the loop calls their methods directly."""

    def __init__(self, ctx: PlacementContext) -> None:
        self.config = ctx.config
        self.roles: dict[str, Any] = {}

    def create_role(self, role: str, cls: type, *args: Any, **kwargs: Any) -> Any:
        obj = cls(*args, **kwargs)
        self.roles[role] = obj
        return obj

    def describe(self) -> dict[str, str]:
        return {role: "this process" for role in self.roles}

    def shutdown(self) -> None:
        for obj in self.roles.values():
            stop = getattr(obj, "shutdown", None)
            if callable(stop):
                stop()
        self.roles.clear()
