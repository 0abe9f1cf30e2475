"""Python entry points: the same path as ``rlhf train``, from a script or a notebook.

    from rlhf_plugins.api import train
    run_dir = train({"algo": {"advantage": {"estimator": "rloo"}}, "train": {"steps": 50}},
                    plugins=["my_reward.py"])
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console

from .config.loading import build_config
from .config.options import OptionRegistry
from .config.schema import Config
from .config.validate import Plan, validate
from .core.manager import RLHFPluginManager, create_manager


def prepare(raw: dict[str, Any] | None = None, plugins: Iterable[str] = (), *, autoload: bool | None = None,
            inline: Iterable[tuple[str, object]] = ()) -> tuple[Config, RLHFPluginManager, Plan]:
    """Load plugins (CLI ones plus the config's ``plugins:``, and plugin objects given from
    Python as ``inline`` (name, object) pairs), build and validate the config."""
    raw = dict(raw or {})
    listed = raw.get("plugins") or []
    listed = list(listed) if isinstance(listed, (list, tuple)) else [listed]
    # plugin files by absolute path: the saved config (and a resume from elsewhere) finds them
    all_plugins = list(dict.fromkeys(_absolute(p) for p in [*listed, *plugins]))
    pm = create_manager(all_plugins, autoload=autoload, inline=inline)
    options = OptionRegistry()
    pm.add_options(options)
    raw["plugins"] = all_plugins
    config = build_config(raw, options)
    plan = validate(config, pm)
    from .config.scale import apply_scale_defaults, given_keys

    plan.steps_given = "train.steps" in given_keys(raw)
    note = apply_scale_defaults(config, raw)
    if note:
        plan.notes.append(note)
    return config, pm, plan


#: keys that may change when a run is resumed (extend it, or change how it reports and waits)
SAFE_TO_CHANGE = ("train.steps", "train.episodes", "train.progress", "train.save_every", "train.keep_checkpoints",
                  "train.save_final", "ray.address", "ray.ready_timeout", "ray.connect_timeout", "ray.log_to_driver",
                  "ray.call_timeout", "ray.max_restarts", "reward.max_retries", "reward.timeout", "plugins", "eval.",
                  "train.best_")


#: keys added since a run may have begun whose default is not what runs began without them did: a saved config
#: lacking one resumes with this value, the behaviour it ran with (weight decay reached every parameter then;
#: the model's dropout stayed as its config set it)
BEFORE_THE_KEY = {("learner", "weight_decay_all"): True, ("learner", "disable_dropout"): False}


def _as_it_ran(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with :data:`BEFORE_THE_KEY`'s values for the keys it lacks."""
    for (section, key), value in BEFORE_THE_KEY.items():
        if isinstance(saved.get(section), dict) and key not in saved[section]:
            saved[section][key] = value
    return saved


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def prepare_resume(target: str | Path, overrides: dict[str, Any] | None = None, plugins: Iterable[str] = (),
                   *, autoload: bool | None = None,
                   inline: Iterable[tuple[str, object]] = ()) -> tuple[Config, RLHFPluginManager, Plan]:
    """The config of a run being resumed: its saved ``config.yaml`` plus ``overrides``; a change to
    anything but :data:`SAFE_TO_CHANGE` is refused naming the keys. The plan carries
    ``resume = (run directory, checkpoint folder)``."""
    from .config.loading import load_yaml, merge
    from .errors import ConfigError
    from .training import checkpoint

    run_dir, folder = checkpoint.find(Path(target))
    saved = _as_it_ran(load_yaml(run_dir / "config.yaml"))
    config, pm, plan = prepare(merge(saved, overrides or {}), plugins, autoload=autoload, inline=inline)
    before, after, given = _flatten(saved), _flatten(config.to_dict()), set(_flatten(overrides or {}))
    # a key the saved config lacks is one added since the run began: its default keeps the old
    # behaviour (or BEFORE_THE_KEY's value does), so only a value given now counts as a change
    changed = sorted(k for k in set(before) | set(after) if (k in before or k in given)
                     and before.get(k) != after.get(k) and not k.startswith(SAFE_TO_CHANGE))
    if changed:
        shown = ", ".join(f"{k} ({before.get(k)!r} -> {after.get(k)!r})" for k in changed[:5])
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        raise ConfigError(f"resuming '{run_dir}' with a different config: {shown}{more}; only "
                          f"{', '.join(SAFE_TO_CHANGE[:2])} and logging settings may change (start a new run instead)")
    plan.resume = (run_dir, folder)
    plan.steps_given = "train.episodes" not in given or "train.steps" in given  # more episodes: count again
    return config, pm, plan


def _absolute(plugin: str) -> str:
    if plugin.endswith(".py") and not plugin.startswith("no:") and Path(plugin).expanduser().is_file():
        return str(Path(plugin).expanduser().resolve())
    return plugin


def offline_defaults() -> None:
    for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)


def train(raw: dict[str, Any] | None = None, *, plugins: Iterable[str] = (), inline: Iterable[tuple[str, object]] = (),
          rows: list[dict[str, Any]] | None = None, console: Console | None = None,
          resume: str | Path | None = None) -> Path:
    """Validate, train and save; returns the run directory. ``rows`` replaces ``data.path``
    with prompts in memory (dicts with the prompt column and any others). ``resume`` continues
    a run directory (or a checkpoint folder); ``raw`` then holds only the keys to change."""
    from .training.run import run_training

    offline_defaults()
    if resume is not None:
        config, pm, plan = prepare_resume(resume, raw, plugins, inline=inline)
    else:
        config, pm, plan = prepare(raw, plugins, inline=inline)
    return run_training(config, pm, plan, console or Console(), rows=rows, resume=plan.resume)
