"""The config schema as plugins extend it: ``rlhf_add_options`` adds typed sections here."""
from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import PluginError
from .schema import Config


class OptionRegistry:
    """The config schema: the core sections plus those plugins add in ``rlhf_add_options``."""

    def __init__(self, plugin_of_module: Any = None) -> None:
        self.sections: dict[str, type] = {}
        self.providers: dict[str, str] = {}
        #: module name -> the plugin defined there (the plugin manager sets it), naming the provider
        #: of a section that was added without ``provider=``
        self.plugin_of_module = plugin_of_module

    def add_section(self, name: str, cls: type, *, provider: str | None = None) -> None:
        if not dataclasses.is_dataclass(cls):
            raise PluginError(f"config section '{name}' must be a dataclass type, got {cls!r}")
        core = {f.name for f in dataclasses.fields(Config)}
        if name in core or name in self.sections:
            raise PluginError(f"config section '{name}' is already defined; pick another name")
        self.sections[name] = cls
        if provider is None and self.plugin_of_module is not None:
            import sys

            provider = self.plugin_of_module(sys._getframe(1).f_globals.get("__name__", ""))
        if provider:
            self.providers[name] = provider
