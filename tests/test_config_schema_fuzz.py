"""Generated from the config schema: every numeric key (core sections and every plugin's) gets -1,
0, a huge number, nan, inf and a word; every choice key a wrong word. Each value is either valid by
the key's declared range, or refused before anything starts with one line that names the key."""
from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from rlhf_plugins.config import Config, OptionRegistry
from rlhf_plugins.config.loading import build_config
from rlhf_plugins.config.validate import validate
from rlhf_plugins.core.manager import create_manager
from rlhf_plugins.errors import UsageError
from rlhf_plugins.settings import _out_of_bounds

VALUES = [-1, 0, 1e30, float("nan"), float("inf"), "abc"]
#: component-name keys (strings chosen from a registry)
COMPONENT_KEYS = {"generation.backend", "learner.backend", "placement.strategy", "algo.advantage.estimator",
                  "algo.policy_loss.name", "algo.kl.estimator", "sync.method", "algo.policy_loss.aggregation"}


@pytest.fixture(scope="module")
def schema():
    pm = create_manager(autoload=False)
    options = OptionRegistry()
    pm.add_options(options)
    return pm, options


def keys_of(cls: type, prefix: str = "") -> list[tuple[str, typing.Any, dataclasses.Field]]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in ("extra", "plugins"):
            continue
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += keys_of(tp, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", tp, f))
    return out


def all_keys(options: OptionRegistry) -> list[tuple[str, typing.Any, dataclasses.Field]]:
    keys = keys_of(Config)
    for name, cls in options.sections.items():
        keys += keys_of(cls, f"{name}.")
    return keys


def numeric(tp: typing.Any) -> type | None:
    args = typing.get_args(tp) or (tp,)
    for a in args:
        if a in (int, float):
            return a
    return None


def choices(tp: typing.Any) -> tuple | None:
    for a in typing.get_args(tp) or (tp,):
        if typing.get_origin(a) is typing.Literal:
            return typing.get_args(a)
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None


def nested(key: str, value: typing.Any) -> dict:
    tree: dict = {}
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return tree


def attempt(pm, options, key, value) -> str | None:
    try:
        validate(build_config(nested(key, value), options), pm)
    except UsageError as exc:
        return str(exc)
    return None


def test_the_schema_has_every_section(schema):
    _, options = schema
    keys = [k for k, _, _ in all_keys(options)]
    assert {"ray.actor_workers", "vllm.num_engines", "lora.rank", "deepspeed.zero_stage", "train.seed"} <= set(keys)
    assert len(keys) > 90


def test_every_numeric_key_is_valid_by_its_range_or_refused_naming_it(schema):
    pm, options = schema
    checked = 0
    for key, tp, f in all_keys(options):
        kind = numeric(tp)
        if kind is None or typing.get_origin(tp) is list:
            continue
        for value in VALUES:
            error = attempt(pm, options, key, value)
            valid_number = isinstance(value, (int, float)) and math.isfinite(value) and \
                (kind is float or float(value).is_integer()) and not _out_of_bounds(value, f.metadata)
            if valid_number and error is None:
                continue
            assert error is not None, f"{key}={value!r} was accepted though out of its range {dict(f.metadata)}"
            assert f"'{key}'" in error or f"--{key}" in error or key in error, f"{key}={value!r}: {error}"
            assert "\n" not in error
            checked += 1
    assert checked > 150


def test_every_choice_key_refuses_a_wrong_word_naming_it(schema):
    pm, options = schema
    tried = 0
    for key, tp, _ in all_keys(options):
        if choices(tp) is None and key not in COMPONENT_KEYS:
            continue
        error = attempt(pm, options, key, "no-such-choice")
        assert error is not None and key in error and "\n" not in error, (key, error)
        tried += 1
    assert tried >= 12
