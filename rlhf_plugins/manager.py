"""The plugin manager: loads builtin, entry-point and ``--plugin`` plugins, and
collects their components into a registry the config picks from by name."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Iterator

import pluggy

from ._markers import ENTRY_POINT_GROUP, PROJECT
from ._version import __version__
from .errors import ConfigError, PluginError
from .hookspecs import SPEC_MODULES
from .types import AREAS, Component

logger = logging.getLogger("rlhf_plugins")

DISABLE_AUTOLOAD_ENV = "RLHF_DISABLE_PLUGIN_AUTOLOAD"


@dataclass(frozen=True)
class PluginSpec:
    """Everything needed to rebuild the same manager in another process (a Ray worker):
    the ``--plugin`` arguments, autoload, and plugin objects registered from Python
    (pickled by value, so callables defined in a user's script travel too)."""

    plugins: tuple[str, ...] = ()
    autoload: bool | None = None
    inline: tuple[tuple[str, bytes], ...] = ()

    def build(self) -> RLHFPluginManager:
        import pickle

        inline = [(name, pickle.loads(blob)) for name, blob in self.inline]
        return RLHFPluginManager().setup(self.plugins, autoload=self.autoload, inline=inline)


@dataclass(frozen=True)
class PluginInfo:
    name: str
    source: str  # "builtin" | "entry point" | "--plugin" | "python"
    version: str
    location: str = ""


@dataclass
class ComponentRow:
    area: str
    name: str
    provider: str
    component: Component


class ComponentRegistry:
    """Components of every area, by name, with the plugin that provided each."""

    def __init__(self) -> None:
        self._rows: dict[type[Component], dict[str, ComponentRow]] = {cls: {} for cls in AREAS.values()}

    def add(self, component: Component, provider: str) -> None:
        area = self._rows[_area_class(component)]
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
            raise ConfigError(f"unknown {cls.area} '{name}'; choose one of: {choices}")
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


def _area_class(component: Component) -> type[Component]:
    for cls in AREAS.values():
        if isinstance(component, cls):
            return cls
    raise TypeError(f"{component!r} is not a component of any area")


class _FunctionRewards:
    """Adapter for the simplest plugin: a module of plain reward functions with
    TRL's signature ``(prompts, completions, **kwargs)`` and no hooks."""

    def __init__(self, module: ModuleType, functions: list[Any]) -> None:
        self.module = module
        self.functions = functions

    def rlhf_reward_functions(self) -> Iterable[Component]:
        from .integrations.reward_functions import as_reward_function

        for fn in self.functions:
            yield as_reward_function(fn)


def _plain_reward_functions(module: ModuleType) -> list[Any]:
    from .integrations.reward_functions import looks_like_reward

    out = []
    for attr, value in vars(module).items():
        if attr.startswith("_") or not inspect.isfunction(value):
            continue
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if looks_like_reward(value):
            out.append(value)
    return out


class RLHFPluginManager(pluggy.PluginManager):
    """pluggy manager with the ``rlhf`` hookspecs and typed calls for every hook."""

    def __init__(self) -> None:
        super().__init__(PROJECT)
        for module in SPEC_MODULES:
            self.add_hookspecs(module)
        self.infos: dict[str, PluginInfo] = {}
        self.warnings: list[str] = []
        self._registry: ComponentRegistry | None = None
        self.spec = PluginSpec()

    # --- loading ---------------------------------------------------------
    def parse_hookimpl_opts(self, plugin: object, name: str):  # type: ignore[override]
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("rlhf_"):
            method = getattr(plugin, name, None)
            if inspect.isroutine(method):
                opts = {}  # unmarked rlhf_* functions are hooks, as in pytest
        return opts

    def setup(self, plugin_args: Iterable[str] = (), *, autoload: bool | None = None,
              inline: Iterable[tuple[str, object]] = ()) -> RLHFPluginManager:
        """Load plugins in pytest's order: blocks, builtins, entry points, ``--plugin``, then
        plugin objects given from Python (``inline``: name, object)."""
        args = [a for a in plugin_args if a]
        inline = list(inline)
        if autoload is None:
            autoload = not os.environ.get(DISABLE_AUTOLOAD_ENV)
        blobs: tuple[tuple[str, bytes], ...] = ()
        if inline:
            import cloudpickle

            blobs = tuple((name, cloudpickle.dumps(obj)) for name, obj in inline)
        self.spec = PluginSpec(tuple(args), autoload, blobs)
        for arg in args:
            if arg.startswith("no:"):
                self.set_blocked(arg[3:])
        self.load_builtins()
        if autoload:
            self.load_entrypoints()
        for arg in args:
            if not arg.startswith("no:"):
                self.import_plugin(arg)
        for name, obj in inline:
            self.register(obj, name)
            self.infos[name] = PluginInfo(name, "python", "", type(obj).__name__)
        self.check_pending()
        _MANAGERS[self.spec] = self
        return self

    def check_pending(self) -> None:
        try:
            super().check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin '{exc.plugin and self.get_name(exc.plugin)}': {exc}") from exc

    def register(self, plugin: object, name: str | None = None) -> str | None:  # type: ignore[override]
        self._registry = None
        try:
            return super().register(plugin, name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin '{name}' cannot be registered: {exc}") from exc

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:  # type: ignore[override]
        self._registry = None
        return super().unregister(plugin, name)

    def load_builtins(self) -> None:
        from .builtin_plugins import DEFAULT_PLUGINS

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
        """``--plugin ARG``: an entry-point name, an importable module, or a ``.py`` path."""
        if arg.endswith(".py") or os.sep in arg or "/" in arg:
            self._import_file(arg)
            return
        if self.has_plugin(arg) or self.is_blocked(arg):
            return
        if self.load_entrypoints(only=arg):
            return
        try:
            module = importlib.import_module(arg)
        except ModuleNotFoundError as exc:
            if exc.name and (arg == exc.name or arg.startswith(exc.name + ".")):
                raise PluginError(
                    f"unknown plugin '{arg}': it is not an entry point of group '{ENTRY_POINT_GROUP}', "
                    "an importable module or a .py file; check the name or pip install the plugin"
                ) from exc
            raise PluginError(f"plugin '{arg}' failed to import: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            raise PluginError(f"plugin '{arg}' failed to import: {type(exc).__name__}: {exc}") from exc
        self._register_user_plugin(module, arg)
        version = getattr(module, "__version__", "")
        self.infos[arg] = PluginInfo(arg, "--plugin", str(version), getattr(module, "__file__", "") or "")

    def _import_file(self, arg: str) -> None:
        path = Path(arg).expanduser()
        if not path.is_file():
            raise PluginError(f"plugin file '{arg}' does not exist; give a path to a .py file")
        name = path.stem
        if self.has_plugin(name) or self.is_blocked(name):
            return
        modname = f"{FILE_MODULE_PREFIX}{name}"
        spec = importlib.util.spec_from_file_location(modname, path)
        if spec is None or spec.loader is None:
            raise PluginError(f"plugin file '{arg}' cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(modname, None)
            raise PluginError(f"plugin '{arg}' failed to import: {type(exc).__name__}: {exc}") from exc
        self._register_user_plugin(module, name)
        self.infos[name] = PluginInfo(name, "--plugin", "", str(path.resolve()))

    def _register_user_plugin(self, plugin: object, name: str) -> None:
        has_hooks = any(self.parse_hookimpl_opts(plugin, attr) is not None for attr in dir(plugin))
        if not has_hooks and isinstance(plugin, ModuleType):
            functions = _plain_reward_functions(plugin)
            if not functions:
                raise PluginError(
                    f"plugin '{name}' defines no rlhf_* hooks and no reward function "
                    "'(prompts, completions, **kwargs) -> list[float]'"
                )
            plugin = _FunctionRewards(plugin, functions)
        self.register(plugin, name)

    # --- components --------------------------------------------------------
    @property
    def components(self) -> ComponentRegistry:
        """Collect every registration hook once; provenance is kept per component."""
        if self._registry is None:
            registry = ComponentRegistry()
            for hookname, cls in AREAS.items():
                caller = getattr(self.hook, hookname)
                for impl in caller.get_hookimpls():  # registration order: builtins first
                    try:
                        items = impl.function() or ()
                        items = list(items)
                    except Exception as exc:
                        raise PluginError(
                            f"plugin '{impl.plugin_name}' failed in {hookname}: {type(exc).__name__}: {exc}"
                        ) from exc
                    for item in items:
                        if not isinstance(item, cls):
                            raise PluginError(
                                f"plugin '{impl.plugin_name}' returned {type(item).__name__} from {hookname}; "
                                f"expected {cls.__name__}"
                            )
                        registry.add(item, impl.plugin_name)
            self._registry = registry
        return self._registry

    def plugin_rows(self) -> list[dict[str, Any]]:
        rows = []
        for name, plugin in self.list_name_plugin():
            if plugin is None:
                continue
            info = self.infos.get(name, PluginInfo(name, "registered", ""))
            hooks = sorted(h.name for h in self.get_hookcallers(plugin) or [])
            rows.append(
                {
                    "name": name,
                    "version": info.version,
                    "source": info.source,
                    "location": info.location,
                    "hooks": hooks,
                }
            )
        return rows

    # --- typed hook calls ----------------------------------------------------
    def add_options(self, options: Any) -> None:
        self.hook.rlhf_add_options.call_historic(kwargs={"options": options})

    def configure(self, config: Any) -> None:
        self.hook.rlhf_configure.call_historic(kwargs={"config": config})

    def load_model(self, role: str, path: str, config: Any) -> Any:
        model = self.hook.rlhf_load_model(role=role, path=path, config=config)
        if model is None:
            raise PluginError(f"no plugin loaded the {role} model from '{path}'")
        return model

    def notify(self, hookname: str, **kwargs: Any) -> None:
        """Call a lifecycle hook: every observer on its own; a failing one is a warning."""
        caller = getattr(self.hook, hookname)
        for impl in reversed(caller.get_hookimpls()):
            try:
                impl.function(*[kwargs[a] for a in impl.argnames])
            except Exception as exc:  # observers must not break the run
                msg = f"plugin '{impl.plugin_name}' failed in {hookname}: {type(exc).__name__}: {exc}"
                logger.warning(msg)
                self.warnings.append(msg)


FILE_MODULE_PREFIX = "rlhf_plugin_file_"


def pickle_file_plugins_by_value() -> None:
    """Plugins loaded from a .py file are not importable in Ray workers: ship them by value."""
    import ray.cloudpickle

    for name, module in list(sys.modules.items()):
        if name.startswith(FILE_MODULE_PREFIX):
            ray.cloudpickle.register_pickle_by_value(module)


def create_manager(plugin_args: Iterable[str] = (), *, autoload: bool | None = None,
                   inline: Iterable[tuple[str, object]] = ()) -> RLHFPluginManager:
    return RLHFPluginManager().setup(plugin_args, autoload=autoload, inline=inline)


_MANAGERS: dict[PluginSpec, RLHFPluginManager] = {}


def get_manager(spec: PluginSpec) -> RLHFPluginManager:
    """The manager for ``spec`` in this process: the driver's own, or rebuilt once in a worker."""
    pm = _MANAGERS.get(spec)
    if pm is None:
        pm = _MANAGERS[spec] = spec.build()
    return pm
