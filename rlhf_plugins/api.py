"""Python entry points: the same path as ``rlhf train``, from a script or a notebook.

    from rlhf_plugins.api import train
    run_dir = train({"algo": {"advantage": {"estimator": "rloo"}}, "train": {"steps": 50}},
                    plugins=["my_reward.py"])
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from rich.console import Console

from .config import Config, OptionRegistry
from .config_loading import build_config
from .manager import RLHFPluginManager, create_manager
from .validate import Plan, validate


def prepare(raw: dict[str, Any] | None = None, plugins: Iterable[str] = (), *, autoload: bool | None = None,
            inline: Iterable[tuple[str, object]] = ()) -> tuple[Config, RLHFPluginManager, Plan]:
    """Load plugins (CLI ones plus the config's ``plugins:``, and plugin objects given from
    Python as ``inline`` (name, object) pairs), build and validate the config."""
    raw = dict(raw or {})
    listed = raw.get("plugins") or []
    listed = list(listed) if isinstance(listed, (list, tuple)) else [listed]
    all_plugins = [*listed, *[p for p in plugins if p not in listed]]
    pm = create_manager(all_plugins, autoload=autoload, inline=inline)
    options = OptionRegistry()
    pm.add_options(options)
    raw["plugins"] = all_plugins
    config = build_config(raw, options)
    plan = validate(config, pm)
    return config, pm, plan


def offline_defaults() -> None:
    for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)


def train(raw: dict[str, Any] | None = None, *, plugins: Iterable[str] = (), inline: Iterable[tuple[str, object]] = (),
          rows: list[dict[str, Any]] | None = None, console: Console | None = None) -> Path:
    """Validate, train and save; returns the run directory. ``rows`` replaces ``data.path``
    with prompts in memory (dicts with the prompt column and any others)."""
    from .run import run_training

    offline_defaults()
    config, pm, plan = prepare(raw, plugins, inline=inline)
    return run_training(config, pm, plan, console or Console(), rows=rows)
