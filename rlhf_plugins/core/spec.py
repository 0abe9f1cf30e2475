"""The same plugin manager in every process of a run.

Roles run in the driver (local placement) or in Ray actors; each needs the manager the driver
built (its ``--plugin`` list, autoload setting and plugin objects registered from Python). A
:class:`PluginSpec` says how to rebuild it; :func:`rlhf_plugins.core.manager.get_manager` builds
it once per process.
Plugin objects travel inside the spec as they are: a placement that crosses processes pickles
them (Ray's cloudpickle sends objects defined in a user's script by value).
"""
from __future__ import annotations

import sys
import uuid
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

#: module-name prefix of plugins imported from a ``.py`` path
FILE_MODULE_PREFIX = "rlhf_plugin_file_"


@dataclass(frozen=True)
class PluginSpec:
    plugins: tuple[str, ...] = ()
    autoload: bool | None = None
    #: (name, plugin object) pairs registered from Python, compared by ``token`` only
    inline: tuple[tuple[str, Any], ...] = field(default=(), compare=False, hash=False)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    @staticmethod
    def file_modules() -> list[ModuleType]:
        """Plugins imported from ``.py`` files in this process (not importable by name elsewhere:
        a placement that crosses processes ships them by value)."""
        return [m for name, m in list(sys.modules.items()) if name.startswith(FILE_MODULE_PREFIX)]
