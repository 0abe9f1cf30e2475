"""The run configuration: typed schema (:mod:`.schema`), YAML and dotted flags (:mod:`.loading`),
and validation against the installed components (:mod:`.validate`)."""
from __future__ import annotations

from .options import OptionRegistry
from .schema import Config

__all__ = ["Config", "OptionRegistry"]
