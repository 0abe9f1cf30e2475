"""Checking a config value against the schema's type hints: the conversions a YAML file or a
command-line flag needs (``"1e-3"`` to a number, ``"yes"`` to true, ``a,b`` to a list), and one
line for anything else -- the key, what it expects, what it got, or for an unknown key the closest
known one (and what an OpenRLHF flag is called here)."""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union

from ..errors import ConfigError

BOOL_WORDS = {"yes": True, "on": True, "y": True, "no": False, "off": False, "n": False}


class FlagMapping(dict):
    """A flag's value that YAML read as a mapping, with the text it was read from: a text key takes
    the text (``--data.input_template "Q: {}"`` is a template, not ``{"Q": {}}``)."""

    text = ""


class FlagList(list):
    """A flag's value that YAML read as a list, with the text it was read from (see FlagMapping)."""

    text = ""


def _plain(value: Any) -> Any:
    """``value`` with every flag-read mapping or list inside it made a plain one."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _takes_text(tp: Any) -> bool:
    """A text key: ``str`` or ``str | None``."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)] == [str]
    return tp is str


def _deepest(key: str, value: Any) -> str:
    """The dotted key of the first leaf under an unknown section or key (``actor.adam.lr``, not ``actor``;
    ``critic.muon.lr``, not ``critic.muon``), when that is a flag of OpenRLHF's: its hint names the whole flag."""
    from .openrlhf_flags import lookup

    if isinstance(value, dict):
        for sub, inner in value.items():
            path = _deepest(f"{key}.{sub}", inner)
            if lookup(path):
                return path
    return key


def _unknown(key: str, known: list[str]) -> str:
    """One line for a key the schema lacks: what an OpenRLHF flag is here, else the one key with the
    same last part, else a close spelling (never a key of another meaning: 'seed' is not 'deepspeed')."""
    from .openrlhf_flags import hint as openrlhf_hint

    theirs = openrlhf_hint(key)
    if theirs:
        return f"unknown config key '{key}': {theirs}"
    section, _, leaf = key.rpartition(".")
    same_leaf = [k for k in known if k.rsplit(".", 1)[-1] == leaf]
    if not section and 1 < len(same_leaf) <= 4:  # a bare name ('lr'): every key it ends ('critic.lr', 'learner.lr')
        return f"unknown config key '{key}'; did you mean one of " + ", ".join(f"'{k}'" for k in same_leaf) + "?"
    close = same_leaf[:1] if section or len(same_leaf) == 1 else []
    if not close and section:  # within its section: the one key the leaf begins ('generation.n'), else a spelling
        mine = [k for k in known if k.rpartition(".")[0] == section]
        begun = [k for k in mine if k.rpartition(".")[2].startswith(leaf)]
        close = begun if len(begun) == 1 else difflib.get_close_matches(key, mine, n=1, cutoff=0.75)
    if not close:  # never the section the key is in ('generation' for 'generation.n')
        close = difflib.get_close_matches(key, [k for k in known if not key.startswith(k + ".")], n=1, cutoff=0.75)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown config key '{key}'{hint}"


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


#: the short spellings of a dtype other tools take (accelerate's mixed_precision, OpenRLHF's --bf16)
_SHORT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def _close_choice(value: Any, choices: tuple[Any, ...]) -> Any:
    """The choice a string given for a fixed set of them most likely meant: the same letters in another case,
    a dtype's short name, else a close spelling with the same digits; None when none is."""
    if not isinstance(value, str):
        return None
    names = [c for c in choices if isinstance(c, str)]
    lowered = {c.lower(): c for c in names}
    key = value.strip().lower()
    for guess in (lowered.get(key), lowered.get(_SHORT_DTYPES.get(key, ""))):
        if guess is not None:
            return guess
    digits = "".join(filter(str.isdigit, value))  # float64 is no misspelt float16
    alike = [c for c in names if not digits or "".join(filter(str.isdigit, c)) == digits]
    close = difflib.get_close_matches(value, alike, n=1, cutoff=0.75)
    return close[0] if close else None


def _coerce(value: Any, tp: Any, path: str, known: list[str]) -> Any:
    """``value`` as the type ``tp`` of the config key ``path`` (``known``: every key, for hints)."""
    if isinstance(value, (FlagMapping, FlagList)):
        if _takes_text(tp):
            return value.text
        value = dict(value) if isinstance(value, dict) else list(value)
    origin = typing.get_origin(tp)
    if tp is Any:
        return _plain(value)
    if origin in (Union, types.UnionType):
        return _coerce_union(value, tp, path, known)
    if origin is Literal:
        if value not in typing.get_args(tp):
            close = _close_choice(value, typing.get_args(tp))
            hint = f"; did you mean {close!r}?" if close is not None else ""
            raise ConfigError(f"config key '{path}' must be one of {_type_name(tp)}; got {value!r}{hint}")
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
    if origin is dict and isinstance(value, dict):
        return _plain(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _coerce_section(value, tp, path, known)
    if tp in (bool, int, float, str):
        return _coerce_scalar(value, tp, path)
    if origin is None and isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _expects(tp, path, value)


def _expects(tp: Any, path: str, value: Any) -> ConfigError:
    return ConfigError(f"config key '{path}' expects {_type_name(tp)}, got {value!r}")


def _coerce_union(value: Any, tp: Any, path: str, known: list[str]) -> Any:
    """The first member of ``X | Y | None`` that takes the value."""
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
    raise _expects(tp, path, value)


def _coerce_section(value: Any, tp: type, path: str, known: list[str]) -> Any:
    """A config section (a dataclass) from a mapping; an unknown key is named with a hint."""
    if isinstance(value, tp):
        return value
    if value is None:
        return tp()
    if not isinstance(value, dict):
        raise _expects(tp, path, value)
    hints = _hints(tp)
    kwargs = {}
    for k, v in value.items():
        sub = f"{path}.{k}" if path else k
        if k not in hints:
            raise ConfigError(_unknown(_deepest(sub, v), known))
        kwargs[k] = _coerce(v, hints[k], sub, known)
    return tp(**kwargs)


def _coerce_scalar(value: Any, tp: type, path: str) -> Any:
    """bool from true/false words, int from a whole float, float from a string ("1e-3": YAML reads
    it as one), str from a number; nothing else converts."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:
            return BOOL_WORDS[value.strip().lower()]
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if number:
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(value, str) or number:  # str
        return value if isinstance(value, str) else str(value)
    raise _expects(tp, path, value)
