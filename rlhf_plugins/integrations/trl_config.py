"""A TRL user's ``GRPOConfig`` or ``RLOOConfig`` (the object, or a ``trl grpo --config`` / ``trl rloo --config``
YAML) as our config.

Every field of TRL's config is accounted for: mapped to one of ours (``DIRECT``, or derived by
hand), ignored with a reason (``IGNORED_WHY``, trainer bookkeeping), or -- when it changes
training and we have no equivalent -- an error naming it, unless left at TRL's default.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, get_args

from ..errors import ConfigError
from .trl_algorithm import adaptive_entropy, algorithm, reference_sync, rloo_algorithm
from .trl_cadence import cadence, fields_read
from .trl_fields import (
    BOOKKEEPING_PREFIXES,
    DERIVED,
    DIRECT,
    DTYPES,
    GENERATION_KWARGS,
    IGNORED_WHY,
    INIT_IGNORED,
    LEGACY,
    current_defaults,
    expected,
    fold_renamed,
    mapping,
)
from .trl_optimizer import optimizer

#: the TRL trainers whose configs convert: name -> (trl's config class, trainer class)
TRAINERS = {"grpo": ("GRPOConfig", "GRPOTrainer"), "rloo": ("RLOOConfig", "RLOOTrainer")}


def grpo_defaults() -> dict[str, Any]:
    return trl_defaults("grpo")


def trl_defaults(trainer: str) -> dict[str, Any]:
    """Every field of the trainer's TRL config with TRL's default."""
    import trl

    out = {}
    for f in dataclasses.fields(getattr(trl, TRAINERS[trainer][0])):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    from ..config.loading import set_dotted

    set_dotted(tree, dotted, value)


def from_grpo_fields(fields: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """TRL GRPOConfig fields (missing ones take TRL's defaults) -> (our raw config, notes)."""
    return from_trl_fields(fields, "grpo")


def from_trl_fields(fields: dict[str, Any], trainer: str) -> tuple[dict[str, Any], list[str]]:
    """The fields of TRL's config for ``trainer`` (grpo or rloo; missing ones take TRL's defaults) -> (our raw
    config, notes). The two share every field but their algorithms' (:mod:`.trl_algorithm`)."""
    defaults = current_defaults(trl_defaults(trainer))
    fields, legacy = {k: v for k, v in fold_renamed(fields).items() if k not in LEGACY}, _legacy(fields)
    changed = _check_fields(fields, defaults, trainer)
    f = {**defaults, **fields}
    raw: dict[str, Any] = {}
    # TRL's prompt formats: a plain string is tokenized as it is ("standard"), a list of messages is
    # rendered with the chat template ("conversational")
    _set(raw, "data.template_strings", False)
    _set(raw, "algo.policy_loss.log_entropy", True)  # TRL logs the policy's entropy at every step
    notes: list[str] = []
    for key, value, note in legacy:
        if value is not None:
            _set(raw, key, value)
        notes.append(note)
    for name, (key, conv) in DIRECT.items():
        if name in f and (name in changed or not name.startswith("vllm_")):
            try:
                _set(raw, key, conv(f[name]))
            except (TypeError, ValueError):
                raise ConfigError(f"TRL field '{name}' expects {expected(conv)}; got {f[name]!r}") from None
    (rloo_algorithm if trainer == "rloo" else algorithm)(f, raw, notes)
    updates_per_rollout = _batch_shape(f, raw, notes)
    reference_sync(f, raw, notes, updates_per_rollout)
    adaptive_entropy(f, raw, notes, updates_per_rollout)
    cadence(f, raw, notes, changed, updates_per_rollout)
    _model_init(f, raw, notes)  # before _run_settings: bf16 / fp16 decide the dtype when set
    _run_settings(f, raw, notes)
    _compile(f, raw, notes)
    _generation_kwargs(f, raw)
    notes += _leftovers(f, changed)
    return raw, notes


def _legacy(fields: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(our key, value or None, note) for each field of an earlier TRL release the config holds."""
    out = []
    for name in sorted(k for k in fields if k in LEGACY):
        key, conv, note = LEGACY[name]
        if fields[name] is None:
            out.append((key, None, f"TRL field '{name}' (null) is ignored: --{key} keeps its default"))
            continue
        try:
            out.append((key, conv(fields[name]), note))
        except (TypeError, ValueError):
            raise ConfigError(f"TRL field '{name}' expects {expected(conv)}; got {fields[name]!r}") from None
    return out


def _check_fields(fields: dict[str, Any], defaults: dict[str, Any], trainer: str) -> set[str]:
    """The fields a config changes from TRL's defaults; an unknown field is an error (naming the other
    trainer where the field is its config's)."""
    unknown = [k for k in fields if k not in defaults]
    if unknown:
        import difflib

        other = "rloo" if trainer == "grpo" else "grpo"
        close = difflib.get_close_matches(unknown[0], list(defaults), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        if unknown[0] in trl_defaults(other):
            hint = (f"; it is a field of trl.{TRAINERS[other][0]}: run it with --trl-trainer {other} (rlhf convert "
                    f"trl {other} FILE, or {TRAINERS[other][1]} from rlhf_plugins.integrations.trl)")
        raise ConfigError(f"'{unknown[0]}' is not a field of trl.{TRAINERS[trainer][0]}{hint}")
    return {k for k in fields if fields[k] != defaults.get(k)}


def _batch_shape(f: dict[str, Any], raw: dict[str, Any], notes: list[str]) -> int:
    """TRL counts completions; we count prompts per rollout and samples per update. Returns the
    optimizer updates per rollout (TRL's steps per step of ours)."""
    per_device = int(f["per_device_train_batch_size"])
    gas = int(f["gradient_accumulation_steps"])
    per_gen = int(f["steps_per_generation"] or gas)
    completions = int(f["generation_batch_size"] or per_device * per_gen)
    n = int(f["num_generations"])
    if completions % n:
        raise ConfigError(f"TRL generation batch ({completions} completions) is not a multiple of num_generations "
                          f"({n})")
    _set(raw, "train.prompts_per_step", completions // n)
    _set(raw, "learner.micro_batch_size", per_device)
    _set(raw, "learner.mini_batch_size", per_device * gas if per_device * gas < completions else 0)
    updates_per_rollout = int(f["num_iterations"]) * max(1, per_gen // gas)
    if int(f["max_steps"]) > 0:
        steps = math.ceil(int(f["max_steps"]) / updates_per_rollout)
        _set(raw, "train.steps", steps)
        if steps * updates_per_rollout != int(f["max_steps"]):  # TRL stops inside its last generation's updates
            notes.append(f"max_steps {f['max_steps']} is {int(f['max_steps']) / updates_per_rollout:g} rollouts of "
                         f"{updates_per_rollout} updates; the run makes {steps} whole rollouts, "
                         f"{steps * updates_per_rollout} updates (its schedule over them)")
    else:  # num_train_epochs passes over the dataset: the run counts the steps once its prompts are loaded
        _set(raw, "train.episodes", float(f["num_train_epochs"]))
    return updates_per_rollout


def _run_settings(f: dict[str, Any], raw: dict[str, Any], notes: list[str]) -> None:
    """Precision, output folder and name, prompt order, optimizer and schedule, tool rounds, the vLLM
    engine."""
    if f.get("bf16"):
        _set(raw, "model.dtype", "bfloat16")
    elif f.get("fp16"):
        _set(raw, "model.dtype", "float16")
    if f.get("output_dir"):
        _set(raw, "train.output_dir", str(f["output_dir"]))
    if f.get("run_name"):
        _set(raw, "train.run_name", str(f["run_name"]))
    strategy = str(f.get("train_sampling_strategy") or "random")
    if strategy not in ("random", "sequential"):
        raise ConfigError(f"TRL train_sampling_strategy '{strategy}' has no equivalent; use random or sequential")
    if strategy == "sequential":
        _set(raw, "data.shuffle", False)
    optimizer(f, raw, notes)
    if f.get("max_tool_calling_iterations") is not None:  # rounds of tool calls: one more model turn
        _set(raw, "env.max_turns", int(f["max_tool_calling_iterations"]) + 1)
    if f["use_vllm"]:
        _set(raw, "generation.backend", "vllm")


def _model_init(f: dict[str, Any], raw: dict[str, Any], notes: list[str]) -> None:
    """model_init_kwargs (from_pretrained's arguments) and trust_remote_code: what carries over."""
    kwargs = dict(f.get("model_init_kwargs") or {})
    dtype = str(kwargs.pop("dtype", kwargs.pop("torch_dtype", "auto"))).removeprefix("torch.")
    if dtype in DTYPES:
        _set(raw, "model.dtype", dtype)
    elif dtype != "auto":
        raise ConfigError(f"TRL model_init_kwargs dtype {dtype!r} has no equivalent; choose one of: "
                          f"{', '.join(DTYPES)}")
    if kwargs.pop("trust_remote_code", False) or f.get("trust_remote_code"):  # from_pretrained's, or TRL 1.x's
        _set(raw, "model.trust_remote_code", True)
    for key, why in INIT_IGNORED.items():
        if kwargs.pop(key, None) is not None:
            notes.append(f"TRL model_init_kwargs '{key}' is ignored: {why}")
    if kwargs:
        keys = ", ".join(map(repr, sorted(kwargs)))
        raise ConfigError(f"TRL model_init_kwargs: no equivalent in rlhf-plugins for {keys}; remove them from the "
                          "TRL config")


def _compile(f: dict[str, Any], raw: dict[str, Any], notes: list[str]) -> None:
    """transformers' Trainer compiles when any of its three fields is set (we: norms, MLPs, head; inductor,
    in the Trainer's mode)."""
    if f.get("torch_compile") or f.get("torch_compile_backend") or f.get("torch_compile_mode"):
        _set(raw, "learner.compile", True)
    from ..config.learner_schema import CompileMode

    mode = f.get("torch_compile_mode")
    if mode in get_args(CompileMode) and mode != "default":
        _set(raw, "learner.compile_mode", mode)
    elif mode not in (None, "default"):
        notes.append(f"TRL field 'torch_compile_mode' ({mode!r}) is ignored: torch.compile has no such mode; "
                     "--learner.compile runs inductor's default mode")
    if f.get("torch_compile_backend") not in (None, "inductor"):
        notes.append(f"TRL field 'torch_compile_backend' ({f['torch_compile_backend']!r}) is ignored: "
                     "--learner.compile compiles the decoder's norms, MLPs and head's log-softmax with inductor")


def _generation_kwargs(f: dict[str, Any], raw: dict[str, Any]) -> None:
    """generation_kwargs: the sampling settings we have (over TRL's own fields, as TRL lets them); any other
    key would change what is sampled, so it is one error naming it."""
    try:
        kwargs = mapping(f.get("generation_kwargs"))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"TRL field 'generation_kwargs' expects a mapping; got {f['generation_kwargs']!r} ({exc})") \
            from None
    if kwargs.pop("do_sample", True) is not True:
        raise ConfigError("TRL generation_kwargs do_sample false: GRPO samples its completions; remove do_sample")
    unknown = sorted(k for k in kwargs if k not in GENERATION_KWARGS)
    if unknown:
        raise ConfigError(f"TRL generation_kwargs: no equivalent in rlhf-plugins for {', '.join(map(repr, unknown))}; "
                          f"it takes {', '.join(GENERATION_KWARGS)} (and do_sample true)")
    for name, value in kwargs.items():
        key, conv = GENERATION_KWARGS[name]
        try:
            _set(raw, key, conv(value))
        except (TypeError, ValueError):
            raise ConfigError(f"TRL generation_kwargs '{name}' expects {expected(conv)}; got {value!r}") from None


def _leftovers(f: dict[str, Any], changed: set[str]) -> list[str]:
    """Notes on the changed fields nothing above used: ignored with a reason, or bookkeeping; any
    other changes training and is an error."""
    notes, bookkeeping = [], []
    for name in sorted(changed - (set(DIRECT) | DERIVED | fields_read(f))):
        if name in IGNORED_WHY:
            notes.append(f"TRL field '{name}' is ignored: {IGNORED_WHY[name]}")
        elif name.startswith(BOOKKEEPING_PREFIXES):
            bookkeeping.append(name)
        else:
            raise ConfigError(f"TRL field '{name}' ({f[name]!r}) changes training and has no equivalent in "
                              "rlhf-plugins; remove it from the TRL config")
    if bookkeeping:
        notes.append(f"TRL fields {', '.join(bookkeeping)} are trainer bookkeeping (logging, saving, evaluation, "
                     "devices) that rlhf-plugins does its own way; ignored")
    return notes


def from_trl_yaml(path: str | Path | None, trainer: str = "grpo",
                  fields: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str], list[str]]:
    """A ``trl grpo --config`` (``trl rloo --config``: ``trainer`` rloo) YAML, ``fields`` (TRL's flags) over it
    (or alone) -> (raw config, notes, plugins for its reward_funcs)."""
    from ..config.loading import load_yaml, merge
    from .trl_open_r1 import open_r1_fields
    from .trl_script import script_rewards
    from .trl_stage_yaml import IGNORED, model_fields

    data = {**(dict(load_yaml(path)) if path is not None else {}), **(fields or {})}
    model: dict[str, Any] = {}
    model_notes: list[str] = []
    model_fields(data, model, model_notes, "model.trust_remote_code")  # ModelConfig's: dtype, use_peft + lora_*
    for key in ("attn_implementation", "model_revision", "lora_task_type"):
        if key in data:
            data.pop(key)
            model_notes.append(f"TRL field '{key}' is ignored: {IGNORED[key]}")
    script = {key: data.pop(key) for key in ("model_name_or_path", "dataset_name", "reward_funcs",
                                             "reward_model_name_or_path", "dataset_train_split", "dataset_config")
              if key in data}
    open_r1: dict[str, Any] = {}
    open_r1_fields(data, open_r1, model_notes)
    raw, notes = from_trl_fields(data, trainer)
    raw, notes = merge(merge(raw, model), open_r1), notes + model_notes
    if script.get("model_name_or_path"):
        _set(raw, "model.path", str(script["model_name_or_path"]))
    if script.get("dataset_name"):
        _set(raw, "data.path", str(script["dataset_name"]))
    else:  # the embedded task's plain prompts are written for the chat template, as `rlhf train` renders them
        raw["data"].pop("template_strings")
        notes.append("no dataset_name: the embedded default task runs (single-digit sums), its prompts rendered "
                     "with the chat template as `rlhf train` renders them; a dataset_name (a local file) is read "
                     "as TRL reads it")
    plugins = script_rewards(script, raw)
    for key in ("dataset_train_split", "dataset_config"):
        if key in script:
            notes.append(f"TRL field '{key}' is ignored: dataset_name is read as a local file or folder")
    return raw, notes, plugins
