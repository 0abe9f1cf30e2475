"""Reading a run configuration: YAML files, dotted ``--section.key value`` flags, and the
check of every key and value against the typed schema of :mod:`rlhf_plugins.config.schema`."""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from ..errors import ConfigError
from .options import OptionRegistry
from .schema import Config


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {exc.start}); save it as UTF-8") from exc
    except OSError as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise ConfigError(f"config file '{path}' is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections, got {type(data).__name__}")
    return data


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``['--algo.kl.coef', '0.1', '--train.steps=5']`` -> nested dict; values parsed as YAML scalars."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument '{arg}'; config flags look like --section.key value")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args) or (args[i + 1].startswith("--") and len(args[i + 1]) > 2):
                from ..integrations.openrlhf import hint as openrlhf_hint

                theirs = openrlhf_hint(key)
                raise ConfigError(theirs or f"flag '--{key}' needs a value, e.g. --{key} VALUE")
            raw = args[i + 1]
            i += 2
        set_dotted(out, key, _parse_scalar(raw))
    return out


#: words YAML 1.1 would read as booleans; a flag keeps them as text (``--train.run_name off``), and
#: boolean keys accept them as text (``--train.progress off``)
BOOL_WORDS = {"yes": True, "on": True, "y": True, "no": False, "off": False, "n": False}


def _parse_scalar(raw: str) -> Any:
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
        return raw
    return value


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            nxt = node[part] = {}
        node = nxt
    node[parts[-1]] = value


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def build_config(raw: dict[str, Any], options: OptionRegistry | None = None) -> Config:
    """Check every key and value of ``raw`` against the schema and build the config."""
    options = options or OptionRegistry()
    known = _all_keys(options)
    core = {f.name for f in dataclasses.fields(Config) if f.name != "extra"}
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in raw.items():
        if key in core:
            tp = _hints(Config)[key]
            kwargs[key] = _coerce(value, tp, key, known)
        elif key in options.sections:
            extra[key] = _coerce(value, options.sections[key], key, known)
        else:
            raise ConfigError(_unknown(_deepest(key, value), known))
    for name, cls in options.sections.items():
        extra.setdefault(name, cls())
    return Config(**kwargs, extra=extra)


def build_dataclass(raw: dict[str, Any], cls: type) -> Any:
    """Check every key and value of ``raw`` against the dataclass ``cls`` (nested sections
    included) and build it -- the same rules and messages as the run config."""
    known: list[str] = []

    def walk(c: type, prefix: str) -> None:
        for name, tp in _hints(c).items():
            known.append(f"{prefix}{name}")
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.")

    walk(cls, "")
    for key in raw:
        if key not in _hints(cls):
            raise ConfigError(_unknown(key, known))
    return _coerce(raw, cls, "", known)


def _deepest(key: str, value: Any) -> str:
    """The dotted key of the first leaf under an unknown section (``actor.adam.lr``, not ``actor``),
    when that is a flag of OpenRLHF's: its hint names the whole flag."""
    from ..integrations.openrlhf import lookup

    if isinstance(value, dict):
        for sub, inner in value.items():
            path = _deepest(f"{key}.{sub}", inner)
            if lookup(path):
                return path
    return key


def _unknown(key: str, known: list[str]) -> str:
    """One line for a key the schema lacks: what an OpenRLHF flag is here, else the one key with the
    same last part, else a close spelling (never a key of another meaning: 'seed' is not 'deepspeed')."""
    from ..integrations.openrlhf import hint as openrlhf_hint

    theirs = openrlhf_hint(key)
    if theirs:
        return f"unknown config key '{key}': {theirs}"
    leaf = key.rsplit(".", 1)[-1]
    close = [k for k in known if k.rsplit(".", 1)[-1] == leaf][:1] if "." in key else []
    if not close:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown config key '{key}'{hint}"


def _all_keys(options: OptionRegistry) -> list[str]:
    keys: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, tp in _hints(cls).items():
            if name == "extra" and cls is Config:
                continue
            path = f"{prefix}{name}"
            keys.append(path)
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                walk(tp, path + ".")

    walk(Config, "")
    for name, cls in options.sections.items():
        keys.append(name)
        walk(cls, name + ".")
    return keys


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        names = {f.name for f in dataclasses.fields(cls)}
        _HINTS[cls] = {k: v for k, v in typing.get_type_hints(cls).items() if k in names}
    return _HINTS[cls]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"a list of {_type_name(arg)}"
    if tp is type(None):
        return "null"
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str, known: list[str]) -> Any:
    def bad() -> ConfigError:
        return ConfigError(f"config key '{path}' expects {_type_name(tp)}, got {value!r}")

    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path, known)
            except ConfigError:
                continue
        raise bad()
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"config key '{path}' must be one of {_type_name(tp)}; got {value!r}")
        return value
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, tuple):
            value = list(value)
        elif not isinstance(value, list):
            value = [value]
        return [_coerce(v, arg, f"{path}[{i}]", known) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        return dict(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if value is None:
            return tp()
        if not isinstance(value, dict):
            raise bad()
        hints = _hints(tp)
        kwargs = {}
        for k, v in value.items():
            sub = f"{path}.{k}" if path else k
            if k not in hints:
                raise ConfigError(_unknown(sub, known))
            kwargs[k] = _coerce(v, hints[k], sub, known)
        return tp(**kwargs)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:
            return BOOL_WORDS[value.strip().lower()]
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads "1e-3" as a string
            except ValueError:
                pass
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad()
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise bad()
