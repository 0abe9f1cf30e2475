"""Every config key with its type, default, range and meaning, from the schema itself.

The meaning of a key is the ``#:`` comment above its field (the convention Sphinx autodoc reads),
so the core sections and the sections plugins add through ``rlhf_add_options`` document
themselves the same way. ``rlhf train --help`` lists the keys; ``rlhf config [SECTION]`` prints
them as a commented YAML file that ``--config`` accepts.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from ..settings import describe_bounds
from .coerce import _hints
from .options import OptionRegistry
from .schema import Config


@dataclass
class Key:
    path: str
    type: str
    default: Any
    doc: str
    bounds: str


@dataclass
class Section:
    name: str
    #: the plugin that added it (None: a core section)
    provider: str | None
    keys: list[Key]
    #: nested sections, e.g. ``algo`` -> ``advantage``, ``policy_loss``, ``kl``
    children: list[Section]
    doc: str = ""


def field_docs(cls: type) -> dict[str, str]:
    """``{field: text}`` from the ``#:`` comment lines right above each field of a dataclass."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            comment: list[str] = []
            i = node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#:"):
                comment.insert(0, lines[i].strip()[2:].strip())
                i -= 1
            if comment:
                out[node.target.id] = " ".join(comment)
    return out


def type_text(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, __import__("types").UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " | ".join(type_text(a) for a in args) + " | null"
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"list[{type_text(arg)}]"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def section_of(name: str, cls: type, provider: str | None = None, doc: str = "") -> Section:
    docs = field_docs(cls)
    hints = _hints(cls)
    keys, children = [], []
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            children.append(section_of(f"{name}.{f.name}", tp, provider, docs.get(f.name, "")))
            continue
        keys.append(Key(f"{name}.{f.name}", type_text(tp), _default(f), docs.get(f.name, ""),
                        describe_bounds(f.metadata)))
    return Section(name, provider, keys, children, doc)


def sections(options: OptionRegistry) -> list[Section]:
    """The core sections in schema order, then plugin sections by name."""
    core_docs = field_docs(Config)
    hints = _hints(Config)
    out = []
    for f in dataclasses.fields(Config):
        tp = hints.get(f.name)
        if f.name == "extra":
            continue
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out.append(section_of(f.name, tp, None, core_docs.get(f.name, "")))
        else:  # a top-level key (plugins)
            out.append(Section(f.name, None, [Key(f.name, type_text(tp), _default(f), core_docs.get(f.name, ""), "")],
                               []))
    for name in sorted(options.sections):
        out.append(section_of(name, options.sections[name], options.providers.get(name)))
    return out


def all_keys(secs: list[Section]) -> list[Key]:
    out: list[Key] = []
    for s in secs:
        out += s.keys
        out += all_keys(s.children)
    return out


def _value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def help_text(secs: list[Section], width: int = 100) -> str:
    """The key reference of ``rlhf train --help``."""
    lines = ["config keys -- each is a flag (--section.key VALUE) and a YAML key (section: {key: VALUE}):"]

    def emit(s: Section) -> None:
        title = s.name + (f"  (plugin: {s.provider})" if s.provider else "")
        lines.append("")
        lines.append(title + (f" -- {s.doc}" if s.doc else ""))
        for k in s.keys:
            head = f"  --{k.path} {k.type} (default: {_value(k.default)}"
            head += f"; {k.bounds})" if k.bounds else ")"
            lines.append(head)
            if k.doc:
                lines.extend(textwrap.wrap(k.doc, width, initial_indent="      ", subsequent_indent="      "))
        for child in s.children:
            emit(child)

    for s in secs:
        emit(s)
    return "\n".join(lines)


def yaml_template(secs: list[Section], only: str | None = None) -> str:
    """A commented YAML config of every key at its default (``only``: one section), for ``--config``."""
    out: list[str] = []

    def comment(text: str, indent: str) -> None:
        for line in textwrap.wrap(text, 96 - len(indent)):
            out.append(f"{indent}# {line}")

    def emit(s: Section, depth: int) -> None:
        indent = "  " * depth
        name = s.name.rsplit(".", 1)[-1]
        if s.provider:
            comment(f"added by the plugin '{s.provider}'", indent)
        if s.doc:
            comment(s.doc, indent)
        out.append(f"{indent}{name}:")
        inner = "  " * (depth + 1)
        for k in s.keys:
            kind = k.type + (f", {k.bounds}" if k.bounds else "")
            comment(f"{kind}: {k.doc}" if k.doc else kind, inner)
            out.append(f"{inner}{k.path.rsplit('.', 1)[-1]}: {_value(k.default)}")
        for child in s.children:
            emit(child, depth + 1)

    for s in secs:
        if only is not None and s.name != only:
            continue
        if s.name == "plugins":  # a top-level key, not a section
            (k,) = s.keys
            comment(f"{k.type}: {k.doc}", "")
            out.append(f"plugins: {_value(k.default)}")
        else:
            emit(s, 0)
        out.append("")
    return "\n".join(out)
