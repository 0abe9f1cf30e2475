"""The plugin manager: loads builtin, entry-point and ``--plugin`` plugins, calls their hooks,
and collects their components into a registry the config picks from by name.

Lifecycle hooks are called through pluggy's own machinery (so new-style wrappers and hook-call
monitoring see them); each observer implementation is guarded so that one that raises becomes
a warning naming its plugin and the others still run.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

import pluggy

from .._markers import PROJECT
from ..errors import PluginError, UsageError
from ..hookspecs import SPEC_MODULES, lifecycle
from ..types import AREAS
from .loading import PluginInfo, PluginLoading, exit_error, one_line
from .registry import ComponentRegistry
from .spec import PluginSpec

logger = logging.getLogger("rlhf_plugins")

DISABLE_AUTOLOAD_ENV = "RLHF_DISABLE_PLUGIN_AUTOLOAD"
#: observer hooks: each implementation runs on its own (see the module docstring)
LIFECYCLE_HOOKS = tuple(name for name in vars(lifecycle) if name.startswith("rlhf_"))


def _raiser(hook: Any, exc: BaseException) -> str:
    """The plugin whose implementation of ``hook`` is on ``exc``'s traceback."""
    codes, tb = set(), exc.__traceback__
    while tb is not None:
        codes.add(tb.tb_frame.f_code)
        tb = tb.tb_next
    for impl in hook.get_hookimpls():
        if getattr(impl.function, "__code__", None) in codes:
            return impl.plugin_name
    return "?"


def autoload_disabled() -> bool:
    """``RLHF_DISABLE_PLUGIN_AUTOLOAD`` set to anything but empty, 0, false, no or off."""
    return os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


class RLHFPluginManager(PluginLoading, pluggy.PluginManager):
    """pluggy manager with the ``rlhf`` hookspecs and typed calls for every hook."""

    def __init__(self) -> None:
        super().__init__(PROJECT)
        for module in SPEC_MODULES:
            self.add_hookspecs(module)
        self.infos: dict[str, PluginInfo] = {}
        self.requested: set[str] = set()
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
              inline: Iterable[tuple[str, object]] = (), spec: PluginSpec | None = None) -> RLHFPluginManager:
        """Load plugins in pytest's order: blocks, builtins, entry points, ``--plugin``, then
        plugin objects given from Python (``inline``: name, object)."""
        args = [a for a in plugin_args if a]
        inline = tuple(inline)
        if autoload is None:
            autoload = not autoload_disabled()
        self.spec = spec or PluginSpec(tuple(args), autoload, inline)
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
            self.requested.add(name)
        self.check_pending()
        _MANAGERS[self.spec] = self
        return self

    def check_pending(self) -> None:
        try:
            super().check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin '{exc.plugin and self.get_name(exc.plugin)}': {one_line(exc)}") from exc

    def register(self, plugin: object, name: str | None = None) -> str | None:  # type: ignore[override]
        self._registry = None
        try:
            registered = super().register(plugin, name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin '{name}' cannot be registered: {one_line(exc)}") from exc
        self._guard_observers()
        return registered

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:  # type: ignore[override]
        self._registry = None
        return super().unregister(plugin, name)

    # --- observers -----------------------------------------------------------
    def _guard_observers(self) -> None:
        for hookname in LIFECYCLE_HOOKS:
            for impl in getattr(self.hook, hookname).get_hookimpls():
                if impl.wrapper or impl.hookwrapper or getattr(impl.function, "__rlhf_guarded__", False):
                    continue
                impl.function = self._guarded(impl.function, impl.plugin_name, hookname)  # type: ignore[misc]

    def _guarded(self, fn: Any, plugin: str, hookname: str) -> Any:
        @functools.wraps(fn)
        def observer(*args: Any) -> Any:
            try:
                return fn(*args)
            except SystemExit as exc:
                raise exit_error(plugin, f"in {hookname}", exc) from None
            except Exception as exc:  # observers must not break the run
                msg = f"plugin '{plugin}' failed in {hookname}: {type(exc).__name__}: {exc}"
                logger.warning(msg)
                self.warnings.append(msg)
                return None

        observer.__rlhf_guarded__ = True  # type: ignore[attr-defined]
        return observer

    # --- components --------------------------------------------------------
    @property
    def components(self) -> ComponentRegistry:
        """Collect every registration hook once, plugin by plugin (provenance is kept per component)."""
        if self._registry is None:
            registry = ComponentRegistry()
            for hookname, cls in AREAS.items():
                for plugin, results in self.per_plugin(hookname):  # registration order: builtins first
                    for item in (x for batch in results for x in (batch or ())):
                        if not isinstance(item, cls):
                            raise PluginError(
                                f"plugin '{plugin}' returned {type(item).__name__} from {hookname}; "
                                f"expected {cls.__name__}"
                            )
                        registry.add(item, plugin)
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

    def is_builtin(self, plugin_name: str) -> bool:
        info = self.infos.get(plugin_name)
        return info is not None and info.source == "builtin"

    # --- typed hook calls ----------------------------------------------------
    def add_options(self, options: Any) -> None:
        if options.plugin_of_module is None:
            options.plugin_of_module = self._plugin_of_module
        self.hook.rlhf_add_options.call_historic(kwargs={"options": options})

    def _plugin_of_module(self, module: str) -> str | None:
        for name, plugin in self.list_name_plugin():
            if getattr(plugin, "__name__", None) == module or type(plugin).__module__ == module:
                return name
        return None

    def configure(self, config: Any, plan: Any) -> None:
        self.hook.rlhf_configure.call_historic(kwargs={"config": config, "plan": plan})

    def decide(self, hookname: str, **kwargs: Any) -> Any:
        """Call a decision hook (the first answer wins); a plugin that raises, or calls
        ``sys.exit``, is one line naming the plugin and the hook."""
        hook = getattr(self.hook, hookname)
        try:
            return hook(**kwargs)
        except (UsageError, KeyboardInterrupt):
            raise
        except SystemExit as exc:
            raise PluginError(f"plugin '{_raiser(hook, exc)}' called sys.exit({exc.code!r}) in {hookname}") from None
        except Exception as exc:
            raise PluginError(f"plugin '{_raiser(hook, exc)}' raised {type(exc).__name__} in {hookname}: "
                              f"{exc}".splitlines()[0]) from exc

    def load_model(self, role: str, path: str, config: Any) -> Any:
        """The role's model, under the run's seed apart from the caller's random stream: what the checkpoint
        lacks (LoRA adapters, a value head) starts the same on every rank of a sharded learner."""
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.train.seed)
            model = self.decide("rlhf_load_model", role=role, path=path, config=config)
        if model is None:
            raise PluginError(f"no plugin loaded the {role} model from '{path}'")
        if not isinstance(model, torch.nn.Module):
            # pluggy calls the last registered (and tryfirst) implementations first
            impls = ", ".join(i.plugin_name for i in reversed(self.hook.rlhf_load_model.get_hookimpls())
                              if not (i.hookwrapper or i.wrapper))
            raise PluginError(f"rlhf_load_model returned {type(model).__name__} for the {role} model; it must return a "
                              f"torch.nn.Module (plugins implementing it, in call order: {impls})")
        from ..models.loaded import finish_loading

        return finish_loading(model, role, config)

    def per_plugin(self, hookname: str, only: Iterable[str] | None = None, **kwargs: Any) -> Iterator[tuple[str, list]]:
        """Call a hook one implementing plugin at a time (through pluggy, in registration order):
        ``(plugin name, its results)``; a plugin that raises is an error naming it. A plugin with
        several implementations of the hook (``@hookimpl(specname=...)``) is called once: pluggy
        runs all of its implementations in that one call."""
        plugins = [p for _, p in self.list_name_plugin() if p is not None]
        wanted = None if only is None else set(only)
        called: set[str] = set()
        for impl in getattr(self.hook, hookname).get_hookimpls():
            if (wanted is not None and impl.plugin_name not in wanted) or impl.plugin_name in called:
                continue
            called.add(impl.plugin_name)
            others = [p for p in plugins if p is not impl.plugin]
            try:
                results = self.subset_hook_caller(hookname, others)(**kwargs)
            except SystemExit as exc:
                raise exit_error(impl.plugin_name, f"in {hookname}", exc) from None
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(f"plugin '{impl.plugin_name}' failed in {hookname}: "
                                  f"{type(exc).__name__}: {exc}") from exc
            yield impl.plugin_name, results

    def collect_state(self) -> dict[str, Any]:
        """Every plugin's ``rlhf_state_dict``, by plugin name (JSON-checked)."""
        import json

        states = {name: results[0] for name, results in self.per_plugin("rlhf_state_dict")
                  if results and results[0] is not None}
        for name, state in states.items():
            try:
                json.dumps(state)
            except (TypeError, ValueError) as exc:
                raise PluginError(f"plugin '{name}' returned state that is not JSON-serialisable from "
                                  f"rlhf_state_dict: {exc}") from exc
        return states

    def restore_state(self, states: dict[str, Any]) -> None:
        """Hand each plugin back what it saved (``rlhf_load_state_dict``)."""
        for name, state in states.items():
            for _ in self.per_plugin("rlhf_load_state_dict", only=[name], state=state):
                pass

    def notify(self, hookname: str, **kwargs: Any) -> None:
        """Call a lifecycle hook: every observer runs; one that fails is a warning naming it."""
        getattr(self.hook, hookname)(**kwargs)


def create_manager(plugin_args: Iterable[str] = (), *, autoload: bool | None = None,
                   inline: Iterable[tuple[str, object]] = ()) -> RLHFPluginManager:
    return RLHFPluginManager().setup(plugin_args, autoload=autoload, inline=inline)


#: the manager of each spec in this process: the driver's own, or one rebuilt in a worker
_MANAGERS: dict[PluginSpec, RLHFPluginManager] = {}


def get_manager(spec: PluginSpec) -> RLHFPluginManager:
    """The manager for ``spec`` in this process: the driver's own, or rebuilt once in a worker."""
    pm = _MANAGERS.get(spec)
    if pm is None:
        pm = RLHFPluginManager().setup(spec.plugins, autoload=spec.autoload, inline=spec.inline, spec=spec)
        _MANAGERS[spec] = pm
    return pm
