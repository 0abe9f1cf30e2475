"""Local placement: every role is an object in this process."""
from __future__ import annotations

from typing import Any


class LocalPlacement:
    """Roles are constructed in place; the loop calls their methods directly."""

    same_process = True

    def __init__(self, config: Any, plugin_spec: Any, roles: tuple[str, ...] = ()) -> None:
        self.config = config
        self.roles: dict[str, Any] = {}

    def create_role(self, role: str, cls: type, *args: Any, num_workers: int = 1, **kwargs: Any) -> Any:
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
