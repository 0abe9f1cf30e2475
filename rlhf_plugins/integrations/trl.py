"""TRL integration: a TRL user's GRPO config, reward functions and script, on our loop.

* :func:`from_grpo_fields` maps ``GRPOConfig`` fields to our config and says which
  fields it ignores and why; a field that changes training and has no equivalent
  is an error.
* ``rlhf train --trl-config grpo.yaml`` reads a YAML of ``GRPOConfig`` fields (plus
  TRL's ``model_name_or_path``, ``dataset_name`` and ``reward_funcs``).
* :class:`GRPOTrainer` takes the arguments of ``trl.GRPOTrainer``; a script changes
  its import and adds ``rlhf={"placement": {"strategy": "ray"}}`` to run on Ray.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError

#: GRPOConfig field -> (our dotted key, converter)
DIRECT: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "learning_rate": ("learner.lr", float),
    "num_generations": ("generation.n_samples_per_prompt", int),
    "max_completion_length": ("generation.max_new_tokens", int),
    "temperature": ("generation.temperature", float),
    "top_p": ("generation.top_p", float),
    "top_k": ("generation.top_k", lambda v: int(v or 0)),
    "beta": ("algo.kl.coef", float),
    "epsilon": ("algo.policy_loss.clip_low", float),
    "num_iterations": ("learner.epochs", int),
    "max_grad_norm": ("learner.max_grad_norm", float),
    "weight_decay": ("learner.weight_decay", float),
    "adam_epsilon": ("learner.eps", float),
    "seed": ("train.seed", int),
    "entropy_coef": ("algo.policy_loss.entropy_coef", float),
    "gradient_checkpointing": ("learner.gradient_checkpointing", bool),
    "reward_weights": ("reward.weights", lambda v: [float(x) for x in v] if v else []),
    "vllm_gpu_memory_utilization": ("vllm.gpu_memory_utilization", float),
    "vllm_tensor_parallel_size": ("vllm.tensor_parallel_size", int),
    "vllm_max_model_length": ("vllm.max_model_len", lambda v: None if v is None else int(v)),
    "vllm_enable_sleep_mode": ("vllm.sleep", bool),
    "shuffle_dataset": ("data.shuffle", bool),
}
#: fields handled by hand below
DERIVED = {
    "epsilon_high", "loss_type", "scale_rewards", "importance_sampling_level", "per_device_train_batch_size",
    "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size", "max_steps", "use_vllm",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap",
    "bf16", "fp16", "output_dir", "run_name", "use_cpu", "adam_beta1", "adam_beta2", "optim", "lr_scheduler_type",
    "lr_scheduler_kwargs", "warmup_steps", "max_tool_calling_iterations",
}
OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw": "adamw",
              "adam": "adam", "sgd": "sgd"}
SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant",
              "cosine_with_min_lr": "cosine"}
LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
              "dr_grpo": "seq-mean-token-sum-norm"}
SAMPLING_CORRECTION = {"token_truncate": "tis", "token_mask": "icepop", "sequence_mask": "seq_mask_tis",
                       "sequence_truncate": "seq_mask_tis"}
#: fields that change training and that we cannot honour (an error unless left at TRL's default)
UNSUPPORTED = {
    "sync_ref_model": "the reference model stays the initial policy",
    "top_entropy_quantile": "no entropy-quantile token masking",
    "mask_truncated_completions": "truncated completions stay in the loss (see reward.stop_penalty)",
    "repetition_penalty": "no repetition penalty in sampling",
    "min_p": "no min-p sampling",
    "multi_objective_aggregation": "rewards are combined as a weighted sum",
    "off_policy_mask_threshold": "no off-policy masking by threshold",
    "use_adaptive_entropy": "no adaptive entropy coefficient",
    "use_bias_correction_kl": "no bias-corrected KL",
    "delta": "no two-sided (delta) clipping",
}
#: fields that change nothing in training here, and why (one note lists those a config sets)
IGNORED_WHY = {
    "num_train_epochs": "rlhf-plugins counts rollout steps: set max_steps",
    "vllm_mode": "vLLM runs as our generation engine (local or a Ray actor)",
    "gradient_checkpointing_kwargs": "checkpointing always runs non-reentrant",
    "pad_to_multiple_of": "padding to a multiple does not change the loss",
    "use_cache": "the learner never caches; generation always does",
    "disable_dropout": "dropout stays as the model's config sets it (0.0 in Qwen2 and Llama configs)",
    "ds3_gather_for_generation": "weights reach the engine by weight sync",
    "trust_remote_code": "set --model.trust_remote_code",
}
#: trainer bookkeeping this project does its own way (run directory, metrics, checkpoints, devices)
BOOKKEEPING_PREFIXES = ("logging_", "log_", "save_", "eval_", "hub_", "push_to_hub", "report_to", "dataloader_",
                        "ddp_", "fsdp", "trackio", "include_", "skip_memory", "num_completions_to_print",
                        "per_device_eval", "torch_empty_cache", "tf32", "full_determinism", "data_seed",
                        "prediction_loss_only", "remove_unused_columns", "label_names", "length_column_name",
                        "load_best_model", "metric_for_best", "greater_is_better", "ignore_data_skip",
                        "resume_from_checkpoint", "restore_callback", "overwrite_output_dir", "do_", "debug",
                        "local_rank", "project", "batch_eval_metrics", "bf16_full_eval", "fp16_full_eval",
                        "accelerator_config", "deepspeed", "parallelism_config", "num_generations_eval",
                        "vllm_server", "vllm_group_port", "vllm_model_impl", "disable_tqdm")


def grpo_defaults() -> dict[str, Any]:
    from trl import GRPOConfig

    out = {}
    for f in dataclasses.fields(GRPOConfig):
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
    defaults = grpo_defaults()
    unknown = [k for k in fields if k not in defaults]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], list(defaults), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"'{unknown[0]}' is not a field of trl.GRPOConfig{hint}")
    f = {**defaults, **fields}
    changed = {k for k in fields if fields[k] != defaults.get(k)}
    fields = f
    raw: dict[str, Any] = {}
    # TRL's prompt formats: a plain string is tokenized as it is ("standard"), a list of messages is
    # rendered with the chat template ("conversational")
    _set(raw, "data.template_strings", False)
    notes: list[str] = []
    for name, why in UNSUPPORTED.items():
        if name in changed:
            raise ConfigError(f"TRL field '{name}' ({fields[name]!r}) has no equivalent in rlhf-plugins: {why}; "
                              "remove it from the TRL config")
    for name, (key, conv) in DIRECT.items():
        if name in f and (name in changed or not name.startswith("vllm_")):
            try:
                _set(raw, key, conv(f[name]))
            except (TypeError, ValueError):
                expected = getattr(conv, "__name__", "a value")
                raise ConfigError(f"TRL field '{name}' expects {expected}; got {f[name]!r}") from None
    _set(raw, "algo.policy_loss.clip_high", float(f["epsilon_high"] if f["epsilon_high"] is not None else f["epsilon"]))
    _set(raw, "algo.kl.estimator", "k3")
    loss = f["loss_type"]
    if loss not in LOSS_TYPES:
        raise ConfigError(f"TRL loss_type '{loss}' has no equivalent; choose one of: {', '.join(LOSS_TYPES)}")
    _set(raw, "algo.policy_loss.aggregation", LOSS_TYPES[loss])
    if f["importance_sampling_level"] == "sequence":
        _set(raw, "algo.policy_loss.name", "gspo")
    scale = f["scale_rewards"]
    scale = {True: "group", False: "none"}.get(scale, scale)
    estimator = {"group": "group_norm", "none": "dr_grpo", "batch": "reinforce_baseline"}.get(str(scale))
    if estimator is None:
        raise ConfigError(f"TRL scale_rewards '{scale}' has no equivalent; use group, batch or none")
    if scale == "batch":
        notes.append("scale_rewards 'batch' maps to reinforce_baseline (group-mean baseline, batch normalisation)")
    _set(raw, "algo.advantage.estimator", estimator)
    # batch shape: TRL counts completions; we count prompts per rollout and samples per update
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
        _set(raw, "train.steps", math.ceil(int(f["max_steps"]) / updates_per_rollout))
    if f.get("bf16"):
        _set(raw, "model.dtype", "bfloat16")
    elif f.get("fp16"):
        _set(raw, "model.dtype", "float16")
    if f.get("output_dir"):
        _set(raw, "train.output_dir", str(f["output_dir"]))
    if f.get("run_name"):
        _set(raw, "train.run_name", str(f["run_name"]))
    _optimizer(f, raw)
    if f.get("max_tool_calling_iterations") is not None:  # rounds of tool calls: one more model turn
        _set(raw, "env.max_turns", int(f["max_tool_calling_iterations"]) + 1)
    if f["use_vllm"]:
        _set(raw, "generation.backend", "vllm")
        if f["vllm_importance_sampling_correction"]:
            _set(raw, "algo.policy_loss.mismatch", SAMPLING_CORRECTION[f["vllm_importance_sampling_mode"]])
            if f["vllm_importance_sampling_cap"] is not None:
                _set(raw, "algo.policy_loss.mismatch_high", float(f["vllm_importance_sampling_cap"]))
    handled = set(DIRECT) | DERIVED | set(UNSUPPORTED)
    bookkeeping = []
    for name in sorted(changed - handled):
        if name in IGNORED_WHY:
            notes.append(f"TRL field '{name}' is ignored: {IGNORED_WHY[name]}")
        elif name.startswith(BOOKKEEPING_PREFIXES):
            bookkeeping.append(name)
        else:
            raise ConfigError(f"TRL field '{name}' ({fields[name]!r}) changes training and has no equivalent in "
                              "rlhf-plugins; remove it from the TRL config")
    if bookkeeping:
        notes.append(f"TRL fields {', '.join(bookkeeping)} are trainer bookkeeping (logging, saving, evaluation, "
                     "devices) that rlhf-plugins does its own way; ignored")
    return raw, notes


def _optimizer(f: dict[str, Any], raw: dict[str, Any]) -> None:
    """Optimizer and schedule, as TRL's Trainer would run them (its default decays linearly)."""
    # a GRPOConfig object holds enums (SchedulerType.CONSTANT); YAML holds their values
    optim, schedule = (str(getattr(f[k], "value", f[k])) for k in ("optim", "lr_scheduler_type"))
    if optim not in OPTIMIZERS:
        raise ConfigError(f"TRL optim '{optim}' has no equivalent; choose one of: {', '.join(OPTIMIZERS)}")
    if schedule not in SCHEDULERS:
        raise ConfigError(f"TRL lr_scheduler_type '{schedule}' has no equivalent; choose one of: "
                          f"{', '.join(SCHEDULERS)}")
    _set(raw, "learner.optimizer", OPTIMIZERS[optim])
    _set(raw, "learner.betas", [float(f["adam_beta1"]), float(f["adam_beta2"])])
    _set(raw, "learner.lr_scheduler", SCHEDULERS[schedule])
    kwargs = f.get("lr_scheduler_kwargs") or {}
    if schedule == "cosine_with_min_lr":
        ratio = kwargs.get("min_lr_rate")
        if ratio is None and kwargs.get("min_lr") is not None:
            ratio = float(kwargs["min_lr"]) / float(f["learning_rate"])
        _set(raw, "learner.min_lr_ratio", float(ratio or 0.0))
    warmup = float(f.get("warmup_steps") or 0)
    if 0 < warmup < 1:  # transformers 5 reads a warmup_steps below 1 as a ratio
        _set(raw, "learner.warmup_ratio", warmup)
    else:
        _set(raw, "learner.warmup_steps", int(warmup))


def from_trl_yaml(path: str | Path) -> tuple[dict[str, Any], list[str], list[str]]:
    """A ``trl grpo --config`` style YAML -> (raw config, notes, plugins for its reward_funcs)."""
    from ..config.loading import load_yaml

    data = load_yaml(path)
    plugins: list[str] = []
    script: dict[str, Any] = {}
    for key in ("model_name_or_path", "dataset_name", "reward_funcs", "dataset_train_split", "dataset_config"):
        if key in data:
            script[key] = data.pop(key)
    raw, notes = from_grpo_fields(data)
    if script.get("model_name_or_path"):
        _set(raw, "model.path", str(script["model_name_or_path"]))
    if script.get("dataset_name"):
        _set(raw, "data.path", str(script["dataset_name"]))
    funcs = script.get("reward_funcs") or []
    funcs = [funcs] if isinstance(funcs, str) else list(funcs)
    names = []
    for spec in funcs:
        module, _, func = str(spec).rpartition(".")
        if not module:
            raise ConfigError(f"TRL reward_funcs entry '{spec}' must be 'module.function'")
        plugins.append(module)
        names.append(func)
    if names:
        _set(raw, "reward.functions", names)
    for key in ("dataset_train_split", "dataset_config"):
        if key in script:
            notes.append(f"TRL field '{key}' is ignored: dataset_name is read as a local file or folder")
    return raw, notes, plugins


class TRLRewards:
    """A plugin made of TRL reward callables (registered inline; shipped to Ray workers by value)."""

    def __init__(self, funcs: Iterable[Callable[..., Any]]) -> None:
        self.funcs = list(funcs)

    def rlhf_reward_functions(self) -> Iterable[Any]:
        from ..rewards.callables import as_reward_function

        seen: set[str] = set()
        for fn in self.funcs:
            comp = as_reward_function(fn)
            if comp.name in seen:
                raise ConfigError(f"two TRL reward functions are named '{comp.name}'; give them distinct names")
            seen.add(comp.name)
            yield comp


def _peft_to_lora(peft_config: Any) -> dict[str, Any]:
    targets = peft_config.target_modules
    targets = [targets] if isinstance(targets, str) else sorted(targets or [])
    return {"rank": int(peft_config.r), "alpha": float(peft_config.lora_alpha),
            "dropout": float(peft_config.lora_dropout), "target_modules": targets}


class GRPOTrainer:
    """``trl.GRPOTrainer``'s arguments, rlhf-plugins' loop (local or Ray).

    ``model`` is a local model folder, ``reward_funcs`` callables (TRL's signature, sync or
    async) or ``"module.function"`` strings, ``args`` a ``trl.GRPOConfig``, ``train_dataset``
    a ``datasets.Dataset`` or a list of rows with a ``prompt`` column, ``peft_config`` a
    ``peft.LoraConfig``; ``tools``, ``environment_factory`` (one or a dict) and ``rollout_func``
    as TRL takes them (:mod:`rlhf_plugins.integrations.trl_rollouts`). ``rlhf`` overrides our
    config (e.g. the placement).
    """

    def __init__(self, model: str, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 processing_class: Any = None, peft_config: Any = None, tools: list[Callable[..., Any]] | None = None,
                 rollout_func: Callable[..., Any] | None = None, environment_factory: Any = None,
                 rlhf: dict[str, Any] | None = None) -> None:
        from ..config.loading import merge
        from .trl_rollouts import RolloutTrainer, TRLRollouts

        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)} if args is not None else {}
        defaults = grpo_defaults()
        fields = {k: v for k, v in fields.items() if k in defaults and v != defaults[k]}
        raw, self.notes = from_grpo_fields(fields)
        _set(raw, "model.path", str(model))
        funcs = [] if reward_funcs is None else (list(reward_funcs) if isinstance(reward_funcs, (list, tuple))
                                                 else [reward_funcs])
        self.plugins = [f.rpartition(".")[0] for f in funcs if isinstance(f, str)]
        callables = [f for f in funcs if not isinstance(f, str)]
        from ..rewards.callables import component_name

        names = [f.rpartition(".")[2] if isinstance(f, str) else component_name(f.__name__) for f in funcs]
        n = int(raw.get("generation", {}).get("n_samples_per_prompt", 8))
        self.rollouts = TRLRollouts(tools, environment_factory, rollout_func, RolloutTrainer(args, n))
        if self.rollouts.factories and self.rollouts.owns_reward():
            names.append("env_reward")  # TRL adds the environment's get_reward as a reward source
        if not names:
            raise ConfigError("no reward source: pass reward_funcs, or an environment_factory whose environment "
                              "defines get_reward")
        _set(raw, "reward.functions", names)
        if peft_config is not None:
            raw = merge(raw, {"lora": _peft_to_lora(peft_config)})
        if self.rollouts.factories:  # TRL's max_completion_length bounds a whole multi-turn trajectory
            _set(raw, "env.max_total_tokens", int(raw.get("generation", {}).get("max_new_tokens", 256)))
        self.raw = merge(merge(raw, self.rollouts.config()), rlhf or {})
        self.rewards = TRLRewards(callables) if callables else None
        self.rows = None if train_dataset is None else [dict(r) for r in train_dataset]
        self.model_path, self.run_dir = str(model), None
        _epochs_to_steps(self.raw, fields, self.rows)

    def train(self) -> Any:
        """Train through the public Python API (:func:`rlhf_plugins.api.train`); returns what TRL's
        ``train()`` does (``TrainOutput(global_step, training_loss, metrics)``); the run directory is
        ``self.run_dir``, the trained policy ``self.model`` afterwards."""
        from rich.console import Console

        from ..api import train
        from .trl_state import train_output

        console = Console()
        for note in self.notes:
            console.print(f"[yellow]note:[/] {note}")
        inline = [("trl_rewards", self.rewards)] if self.rewards is not None else []
        if self.rollouts.factories or self.rollouts.rollout_func is not None:
            inline.append(("trl_rollouts", self.rollouts))
        self.run_dir = train(self.raw, plugins=self.plugins, inline=inline, rows=self.rows, console=console)
        return train_output(self.run_dir)

    @property
    def state(self) -> Any:
        """TRL's ``trainer.state``: ``global_step``, ``max_steps`` and ``log_history`` (one dict per step)."""
        from .trl_state import trainer_state

        return trainer_state(self.run_dir, self.raw)

    @property
    def model(self) -> Any:
        """The trained policy (``final/``), loaded with transformers (before training: the initial one)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(self.run_dir / "final") if self.run_dir else self.model_path)

    @property
    def processing_class(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path)

    def save_model(self, output_dir: str | None = None) -> None:
        """Copy the trained policy (``final/``: weights, config, tokenizer; a LoRA run's adapter) to
        ``output_dir`` (default: GRPOConfig.output_dir), as TRL's ``save_model`` writes it."""
        import shutil

        if self.run_dir is None:
            raise ConfigError("save_model() before train(): there is no trained model yet")
        target = Path(output_dir or self.raw.get("train", {}).get("output_dir") or "trainer_output")
        shutil.copytree(self.run_dir / "final", target, dirs_exist_ok=True)


def _epochs_to_steps(raw: dict[str, Any], fields: dict[str, Any], rows: list[dict[str, Any]] | None) -> None:
    """Without max_steps TRL runs num_train_epochs passes over the dataset: as many rollout steps here."""
    if int(fields.get("max_steps", -1) or -1) > 0 or rows is None or "steps" in raw.get("train", {}):
        return
    epochs = float(fields.get("num_train_epochs", grpo_defaults()["num_train_epochs"]))
    per_step = int(raw.get("train", {}).get("prompts_per_step", 1))
    _set(raw, "train.steps", max(1, math.ceil(epochs * len(rows) / per_step)))
