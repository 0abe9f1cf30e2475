"""How often a TRL run checkpoints, evaluates and logs its completions, as this project's steps.

TRL counts both in its steps -- optimizer updates -- and a step here is a rollout, which makes
``updates_per_rollout`` of them. Only what a config sets is converted (TRL's own defaults, 500-step
checkpoints kept without limit, stay this project's: every 100 steps, the newest 2 kept).
"""
from __future__ import annotations

import math
from typing import Any

#: the GRPOConfig fields this module reads
CADENCE = {"save_strategy", "save_steps", "save_total_limit", "eval_strategy", "eval_steps", "log_completions",
           "num_completions_to_print"}


def fields_read(f: dict[str, Any]) -> set[str]:
    """The GRPOConfig fields this module converts, ``logging_steps`` among them when it sets the cadence of
    ``log_completions``."""
    return CADENCE | ({"logging_steps"} if f.get("log_completions") else set())


def _plain(value: Any) -> Any:
    """transformers' strategy enums as their strings."""
    return getattr(value, "value", value)


def whole_rollouts(name: str, every: float, per_rollout: int, notes: list[str],
                   here: str = "every {steps} here") -> int:
    """TRL's ``every`` optimizer updates as a count of rollouts (rounded, at least 1), with a note -- ending
    in ``here`` -- where they differ."""
    steps = max(1, round(every / per_rollout))
    if steps * per_rollout != every:
        notes.append(f"{name} {every:g} is {every / per_rollout:g} rollouts of {per_rollout} updates; "
                     f"{here.format(steps=steps)} (after a whole rollout)")
    return steps


def _in_rollouts(f: dict[str, Any], name: str, every: float, per_rollout: int, notes: list[str]) -> int | None:
    """:func:`whole_rollouts` of TRL's ``every`` updates (a fraction below 1: of ``max_steps``, as transformers
    reads it); None where a fraction has no ``max_steps`` to be one of."""
    if every < 1:
        if int(f["max_steps"]) <= 0:
            notes.append(f"{name} {every:g} is a fraction of max_steps, which this config does not set; ignored")
            return None
        every = math.ceil(every * int(f["max_steps"]))
    return whole_rollouts(name, every, per_rollout, notes)


def cadence(f: dict[str, Any], raw: dict[str, Any], notes: list[str], changed: set[str], per_rollout: int) -> None:
    """``save_strategy`` / ``save_steps`` -> ``--train.save_every``, ``save_total_limit`` ->
    ``--train.keep_checkpoints``, ``eval_strategy`` / ``eval_steps`` -> ``--eval.every`` (the held-out set
    is evaluated before the first step and after the last as well)."""
    from ..config.loading import set_dotted as _set

    save = str(_plain(f["save_strategy"]))
    if changed & {"save_strategy", "save_steps"}:
        if save == "no":  # no checkpoints along the way; the trained policy is still saved at the end
            _set(raw, "train.save_every", 0)
        elif save == "steps":
            every = _in_rollouts(f, "save_steps", float(f["save_steps"]), per_rollout, notes)
            if every is not None:
                _set(raw, "train.save_every", every)
        else:
            notes.append(f"save_strategy '{save}' is not converted: checkpoints come every --train.save_every steps"
                         + (" (the best policy by a metric: --train.best_metric)" if save == "best" else ""))
    if "save_total_limit" in changed and f["save_total_limit"]:
        _set(raw, "train.keep_checkpoints", int(f["save_total_limit"]))
    strategy = str(_plain(f["eval_strategy"]))
    if strategy == "steps":
        every = _in_rollouts(f, "eval_steps", float(f["eval_steps"] or f["logging_steps"]), per_rollout, notes)
        if every is not None:
            _set(raw, "eval.every", every)
    elif strategy == "epoch":
        notes.append("eval_strategy 'epoch' is not converted: the held-out set is evaluated before the first step, "
                     "after the last and every --eval.every steps")
    elif "eval_steps" in changed:
        notes.append("eval_steps is unused with eval_strategy 'no' (as in TRL)")
    completions(f, raw, notes, per_rollout)


def completions(f: dict[str, Any], raw: dict[str, Any], notes: list[str], per_rollout: int) -> None:
    """``log_completions`` -> ``--train.log_samples_every`` (TRL's ``logging_steps`` in rollouts: the samples
    of those steps in ``samples.jsonl``), ``num_completions_to_print`` -> ``--train.print_samples`` (TRL's
    None: every sample of the step)."""
    from ..config.loading import set_dotted as _set

    if not f.get("log_completions"):
        return
    every = _in_rollouts(f, "logging_steps", float(f["logging_steps"]), per_rollout, notes)
    if every is not None:
        _set(raw, "train.log_samples_every", every)
        shown = f.get("num_completions_to_print")
        train, generation = raw.get("train", {}), raw.get("generation", {})
        whole = train.get("prompts_per_step", 1) * generation.get("n_samples_per_prompt", 1)
        _set(raw, "train.print_samples", int(shown) if shown else whole)
