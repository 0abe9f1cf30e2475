"""Finding and importing plugins: the builtin tuple, ``rlhf_plugins`` entry points, and
``--plugin`` arguments (entry-point names, importable modules, ``.py`` files)."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .._markers import ENTRY_POINT_GROUP
from .._version import __version__
from ..errors import PluginError
from .spec import FILE_MODULE_PREFIX

logger = logging.getLogger("rlhf_plugins")


@dataclass(frozen=True)
class PluginInfo:
    name: str
    source: str  # "builtin" | "entry point" | "--plugin" | "python"
    version: str
    location: str = ""


def interrupted(plugin: str) -> Exception:
    """Ctrl-C while a plugin imports (a slow or hanging import): say which one."""
    from ..errors import Interrupted

    return Interrupted(f"interrupted while importing plugin '{plugin}'", 130)


def exit_error(plugin: str, where: str, exc: SystemExit) -> PluginError:
    return PluginError(f"plugin '{plugin}' called sys.exit({exc.code!r}) {where}; plugins must raise an error instead")


class PluginLoading:
    """The loading half of :class:`~rlhf_plugins.core.manager.RLHFPluginManager`."""

    infos: dict[str, PluginInfo]
    warnings: list[str]
    #: plugins the run asked for (``--plugin``, ``plugins:``, Python objects), not merely installed
    requested: set[str]

    def load_builtins(self) -> None:
        from ..builtin_plugins import DEFAULT_PLUGINS

        for modname in DEFAULT_PLUGINS:
            name = modname.rsplit(".", 1)[-1]
            if self.is_blocked(name) or self.has_plugin(name):
                continue
            self.register(importlib.import_module(modname), name)
            self.infos[name] = PluginInfo(name, "builtin", __version__, modname)

    def load_entrypoints(self, only: str | None = None) -> bool:
        """Auto-load every entry point of the ``rlhf_plugins`` group (or just ``only``).

        A broken auto-loaded plugin is a warning naming its distribution; one asked
        for by name (``only``) is a hard error. Returns whether ``only`` was found.
        """
        found = False
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if only is not None and ep.name != only:
                continue
            found = True
            if self.is_blocked(ep.name) or self.has_plugin(ep.name):
                continue
            dist = getattr(ep, "dist", None)
            dist_label = f"{dist.name} {dist.version}" if dist else "unknown distribution"
            try:
                plugin = ep.load()
            except KeyboardInterrupt:
                raise interrupted(ep.name) from None
            except SystemExit as exc:
                raise exit_error(ep.name, f"while importing (from {dist_label})", exc) from None
            except Exception as exc:
                if only is not None:
                    raise PluginError(
                        f"plugin '{ep.name}' (from {dist_label}) failed to import: {type(exc).__name__}: {exc}"
                    ) from exc
                msg = (
                    f"plugin '{ep.name}' from distribution {dist_label} failed to import and is skipped: "
                    f"{type(exc).__name__}: {exc} (run with -v for the traceback)"
                )
                self.warnings.append(msg)
                logger.warning(msg)
                logger.debug("".join(traceback.format_exception(exc)))
                continue
            self._register_user_plugin(plugin, ep.name)
            self.infos[ep.name] = PluginInfo(ep.name, "entry point", dist.version if dist else "?", dist_label)
        return found

    def import_plugin(self, arg: str) -> None:
        """``--plugin ARG``: an entry-point name, an importable module, or a ``.py`` path.
        Modules import from the current directory too, as ``python -m`` would."""
        if arg.endswith(".py") or os.sep in arg or "/" in arg:
            self._import_file(arg)
            return
        if self.is_blocked(arg):
            return
        self.requested.add(arg)
        if self.has_plugin(arg):
            local = Path(arg + ".py")  # a user's module named like a builtin plugin wins, as `python -m` would
            if local.is_file():
                self._import_file(str(local))
            return
        if self.load_entrypoints(only=arg):
            return
        if not all(part.isidentifier() for part in arg.split(".")):  # ".", "my-plugin": no module is named so
            raise PluginError(f"unknown plugin '{arg}': it is not an entry point of group '{ENTRY_POINT_GROUP}', "
                              "an importable module or a .py file; check the name or pip install the plugin")
        cwd = os.getcwd()
        if cwd not in sys.path:
            sys.path.append(cwd)
        try:
            module = importlib.import_module(arg)
        except ModuleNotFoundError as exc:
            if exc.name and (arg == exc.name or arg.startswith(exc.name + ".")):
                raise PluginError(
                    f"unknown plugin '{arg}': it is not an entry point of group '{ENTRY_POINT_GROUP}', "
                    "an importable module or a .py file; check the name or pip install the plugin"
                ) from exc
            raise PluginError(f"plugin '{arg}' failed to import: {type(exc).__name__}: {exc}") from exc
        except KeyboardInterrupt:
            raise interrupted(arg) from None
        except SystemExit as exc:
            raise exit_error(arg, "while importing", exc) from None
        except Exception as exc:
            raise PluginError(f"plugin '{arg}' failed to import: {type(exc).__name__}: {exc}") from exc
        self._register_user_plugin(module, arg)
        version = getattr(module, "__version__", "")
        self.infos[arg] = PluginInfo(arg, "--plugin", str(version), getattr(module, "__file__", "") or "")

    def _import_file(self, arg: str) -> None:
        path = Path(arg).expanduser()
        if path.is_dir():
            raise PluginError(f"plugin '{arg}' is a folder; give a .py file, or a package by its module name (from "
                              "the folder that holds it) or its entry point")
        if not path.is_file():
            raise PluginError(f"plugin file '{arg}' does not exist; give a path to a .py file")
        location = str(path.resolve())
        if any(info.location == location for info in self.infos.values()):
            return  # the same file, named twice (config and command line)
        name = path.stem
        if self.is_blocked(name) or self.is_blocked(path.name):
            return
        if self.has_plugin(name):  # another plugin (a builtin one) has the file's stem: keep both
            name = path.name
        modname = f"{FILE_MODULE_PREFIX}{path.stem}"
        spec = importlib.util.spec_from_file_location(modname, path)
        if spec is None or spec.loader is None:
            raise PluginError(f"plugin file '{arg}' cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module
        from ..environments.openrlhf import agent_imports

        try:
            with agent_imports(path.read_text(errors="replace")):
                spec.loader.exec_module(module)
        except KeyboardInterrupt:
            sys.modules.pop(modname, None)
            raise interrupted(arg) from None
        except SystemExit as exc:
            sys.modules.pop(modname, None)
            raise exit_error(arg, "while importing", exc) from None
        except Exception as exc:
            sys.modules.pop(modname, None)
            hint = ""
            if isinstance(exc, ImportError) and (exc.name or "").split(".")[0] == "openrlhf":
                hint = ("; the file uses OpenRLHF's own helpers: pip install openrlhf (without it only "
                        "openrlhf.utils.agent's base classes and multi-turn executor are provided here)")
            raise PluginError(f"plugin '{arg}' failed to import: {type(exc).__name__}: {exc}{hint}") from exc
        self._register_user_plugin(module, name)
        self.infos[name] = PluginInfo(name, "--plugin", "", location)
        self.requested.add(name)

    def _register_user_plugin(self, plugin: object, name: str) -> None:
        if self.is_registered(plugin):  # a builtin module named as a plugin (``rlhf_plugins.builtin_plugins.rewards``)
            return
        has_hooks = any(self.parse_hookimpl_opts(plugin, attr) is not None for attr in dir(plugin))
        if not has_hooks and isinstance(plugin, ModuleType):
            from ..environments.openrlhf import AgentFile
            from ..rewards.callables import FunctionRewards

            found = AgentFile.of_module(plugin, name) or FunctionRewards.of_module(plugin)
            if found is None:
                raise PluginError(
                    f"plugin '{name}' defines no rlhf_* hooks, no reward function "
                    "'(prompts, completions, **kwargs) -> list[float]' and no OpenRLHF AgentInstance"
                )
            plugin = found
        self.register(plugin, name)


def one_line(exc: Exception) -> str:
    """pluggy's validation message (three lines: plugin and hook, the definition, the reason) as one:
    the hook, then the reason."""
    import re

    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    hook = re.search(r"hook '([^']+)'", lines[0]) if lines else None
    reason = lines[-1] if lines else str(exc)
    return f"its {hook.group(1)}: {reason}" if hook else reason
