"""Reading a run configuration: YAML files, dotted ``--section.key value`` flags, and the
check of every key and value against the typed schema of :mod:`rlhf_plugins.config.schema`."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from .coerce import FlagList, FlagMapping, _coerce, _deepest, _hints, _unknown
from .options import OptionRegistry
from .schema import Config


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        inside = f" (a run's is its config.yaml: '{p / 'config.yaml'}')" if (p / "config.yaml").is_file() else ""
        raise ConfigError(f"config file '{path}' is a folder; give a YAML file{inside}")
    if not p.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    if p.suffix == ".py":
        raise ConfigError(f"config file '{path}' is Python, not YAML; a reward or other plugin in a .py file is "
                          f"loaded with --plugin {path}")
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
    i, key, raw = 0, "", ""
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:  # after one of OpenRLHF's flags of two values: that flag
            from .openrlhf_flags import hint as openrlhf_hint  # the flag table, read only for an error

            after = f" after --{key} {raw}; a list is one value (--{key} {raw},{arg}) and" if key else ";"
            raise ConfigError((key and openrlhf_hint(key)) or
                              f"unexpected argument '{arg}'{after} config flags look like --section.key value")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args) or (args[i + 1].startswith("--") and len(args[i + 1]) > 2):
                from .openrlhf_flags import hint as openrlhf_hint

                theirs = openrlhf_hint(key)
                raise ConfigError(theirs or f"flag '--{key}' needs a value, e.g. --{key} VALUE")
            raw = args[i + 1]
            i += 2
        set_dotted(out, key, _parse_scalar(raw))
    return out


#: words YAML 1.1 would read as booleans; a flag keeps them as text (``--train.run_name off``), and
#: boolean keys accept them as text (``--train.progress off``)
def _parse_scalar(raw: str) -> Any:
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
        return raw
    if isinstance(value, (dict, list)):  # the text stays at hand for a text key
        kept = FlagMapping(value) if isinstance(value, dict) else FlagList(value)
        kept.text = raw
        return kept
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
