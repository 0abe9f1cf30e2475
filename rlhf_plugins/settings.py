"""Config fields with their valid range declared where they are defined.

``steps: int = setting(200, ge=1)`` is a dataclass field whose bounds live in its metadata; every
section -- the core ones and those plugins add -- is checked by :func:`check_bounds` before any
plugin's ``rlhf_configure`` runs and before anything heavy is imported. Every float must also be
finite (no ``nan`` / ``inf`` from a flag or a YAML file).

Plugin authors use it for their own sections::

    @dataclass
    class JudgeOptions:
        timeout: float = setting(10.0, gt=0)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from .errors import ConfigError

_MISSING = dataclasses.MISSING


def setting(default: Any = _MISSING, *, factory: Any = None, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None) -> Any:
    """A dataclass field with bounds: ``ge`` (>=), ``gt`` (>), ``le`` (<=), ``lt`` (<)."""
    metadata = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def describe_bounds(meta: Any) -> str:
    parts = [f"{sym} {meta[k]:g}" for k, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if k in meta]
    return " and ".join(parts)


def _out_of_bounds(value: float, meta: Any) -> bool:
    return (("ge" in meta and not value >= meta["ge"]) or ("gt" in meta and not value > meta["gt"])
            or ("le" in meta and not value <= meta["le"]) or ("lt" in meta and not value < meta["lt"]))


def check_bounds(obj: Any, prefix: str = "") -> None:
    """Every field of the dataclass ``obj`` (recursively) within its declared bounds, every float finite;
    the first offender is one line naming the key."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_bounds(value, key + ".")
            continue
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"config key '{key}' must be a finite number; got {v}")
            if _out_of_bounds(v, f.metadata):
                raise ConfigError(f"config key '{key}' must be {describe_bounds(f.metadata)}; got {v}")
