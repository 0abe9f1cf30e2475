"""TRL integration: a TRL user's GRPO config, reward functions and script, on our loop.

* :func:`from_grpo_fields` (:mod:`.trl_config`) maps ``GRPOConfig`` fields to our config and says which
  fields it ignores and why; a field that changes training and has no equivalent
  is an error.
* ``rlhf train --trl-config grpo.yaml`` reads a YAML of ``GRPOConfig`` fields (plus
  TRL's ``model_name_or_path``, ``dataset_name`` and ``reward_funcs``).
* :class:`GRPOTrainer` takes the arguments of ``trl.GRPOTrainer``; a script changes
  its import and adds ``rlhf={"placement": {"strategy": "ray"}}`` to run on Ray.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .trl_config import _set, from_grpo_fields, from_trl_yaml, grpo_defaults
from .trl_state import AfterTraining

__all__ = ["GRPOTrainer", "TRLRewards", "from_grpo_fields", "from_trl_yaml", "grpo_defaults"]

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


#: LoraConfig fields the lora section holds (with what only names the task or the base)
PLAIN_LORA = {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "peft_type", "base_model_name_or_path",
              "revision", "inference_mode"}


def _peft_to_lora(peft_config: Any, output_dir: str) -> dict[str, Any]:
    """A peft.LoraConfig as the lora section; one that sets more (DoRA, rsLoRA, PiSSA, modules_to_save,
    per-module ranks...) is saved whole as ``<output_dir>/peft_config/adapter_config.json`` for --lora.config."""
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise ConfigError(f"peft_config is a {type(peft_config).__name__}; rlhf-plugins trains LoRA adapters: pass a "
                          "peft.LoraConfig")
    defaults = LoraConfig().to_dict()
    if any(v != defaults.get(k) for k, v in peft_config.to_dict().items() if k not in PLAIN_LORA):
        folder = Path(output_dir) / "peft_config"
        peft_config.save_pretrained(str(folder))
        return {"config": str(folder.resolve())}
    targets = peft_config.target_modules
    targets = [targets] if isinstance(targets, str) else sorted(targets or [])
    return {"rank": int(peft_config.r), "alpha": float(peft_config.lora_alpha),
            "dropout": float(peft_config.lora_dropout), "target_modules": targets}


def _reward_models(funcs: list[Any], raw: dict[str, Any]) -> list[Any]:
    """TRL loads a reward_funcs entry that names a model (a local folder, or a loaded model) as a sequence
    classifier: those become reward.models, TRL's reward_weights reordered to ours (functions, then
    models). Returns the other entries."""
    def folder(f: Any) -> str | None:
        if isinstance(f, str):
            if f and Path(f).is_dir():
                return str(Path(f).resolve())
            if "/" in f:  # a hub name, as TRL would download: never a 'module.function'
                raise ConfigError(f"reward_funcs entry '{f}' is not a local folder; download the reward model "
                                  "(huggingface-cli download) and pass its folder")
            return None
        if not hasattr(f, "config"):  # a callable
            return None
        path = getattr(f, "name_or_path", "") or ""
        if not path or not Path(path).is_dir():
            raise ConfigError(f"reward model {type(f).__name__} ('{path}') is not a local folder; save it with "
                              "save_pretrained and pass the folder")
        return str(Path(path).resolve())

    models = [folder(f) for f in funcs]
    if not any(models):
        return funcs
    weights = raw.get("reward", {}).get("weights") or []
    if weights and len(weights) != len(funcs):
        raise ConfigError(f"TRL reward_weights has {len(weights)} values for {len(funcs)} reward_funcs; give one each")
    if weights:
        _set(raw, "reward.weights", [w for w, m in zip(weights, models) if m is None]
             + [w for w, m in zip(weights, models) if m is not None])
    _set(raw, "reward.models", [m for m in models if m is not None])
    return [f for f, m in zip(funcs, models) if m is None]


def _model_folder(model: Any) -> str:
    """TRL takes a model name or a loaded model: here a local folder, or a model loaded from one."""
    if isinstance(model, (str, Path)):
        return str(model)
    path = getattr(model, "name_or_path", "") or ""
    if not path or not Path(path).is_dir():
        raise ConfigError(f"model {type(model).__name__} ('{path}') is not a local folder; save it with "
                          "save_pretrained and pass the folder")
    return str(Path(path).resolve())


def _own_template(processing_class: Any, model_path: str) -> str | None:
    """The chat template of a tokenizer passed as ``processing_class`` where it is not the model folder's
    (scripts set one on the tokenizer they pass): None when it is the same, or there is none."""
    template = getattr(processing_class, "chat_template", None)
    if not isinstance(template, str):
        return None
    from transformers import AutoTokenizer

    return None if AutoTokenizer.from_pretrained(model_path).chat_template == template else template


def _refuse_hooks(callbacks: Any, optimizers: Any) -> None:
    """transformers' TrainerCallbacks and a ready-made optimizer belong to TRL's Trainer loop, which does
    not run here: one line each, pointing at what does the same."""
    if callbacks:
        raise ConfigError("callbacks are transformers TrainerCallbacks, which this loop does not call; write a "
                          "plugin with rlhf_after_step / rlhf_after_rollout hooks (docs/plugin_hooks.md)")
    if optimizers is not None and any(o is not None for o in optimizers):
        raise ConfigError("optimizers=(optimizer, scheduler) are built for TRL's Trainer; set GRPOConfig's optim, "
                          "learning_rate and lr_scheduler_type (or --learner.optimizer) instead")


def _eval_file(eval_dataset: Any, fields: dict[str, Any]) -> str:
    """The eval_dataset's rows as ``<output_dir>/eval_dataset.jsonl`` (the run reads held-out prompts
    from a file, as it does on Ray workers)."""
    import json

    folder = Path(fields.get("output_dir") or "trainer_output")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "eval_dataset.jsonl"
    path.write_text("".join(json.dumps(dict(row), default=str) + "\n" for row in eval_dataset))
    return str(path.resolve())


def _resume_target(resume: str | bool, raw: dict[str, Any]) -> str:
    """TRL's resume_from_checkpoint: a folder, or True for the newest run under output_dir."""
    if resume is not True:
        return str(resume)
    base = Path(raw.get("train", {}).get("output_dir") or "runs")
    runs = sorted((d for d in base.glob("*") if (d / "checkpoints").is_dir()), key=lambda d: d.stat().st_mtime)
    if not runs:
        raise ConfigError(f"resume_from_checkpoint=True: no run with checkpoints under '{base}'")
    return str(runs[-1])


class GRPOTrainer(AfterTraining):
    """``trl.GRPOTrainer``'s arguments, rlhf-plugins' loop (local or Ray).

    ``model`` is a local model folder, ``reward_funcs`` callables (TRL's signature, sync or
    async) or ``"module.function"`` strings, ``args`` a ``trl.GRPOConfig``, ``train_dataset``
    a ``datasets.Dataset`` or a list of rows with a ``prompt`` column, ``peft_config`` a
    ``peft.LoraConfig``; ``tools``, ``environment_factory`` (one or a dict) and ``rollout_func``
    as TRL takes them (:mod:`rlhf_plugins.integrations.trl_rollouts`). ``rlhf`` overrides our
    config (e.g. the placement).
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: Any = (None, None), peft_config: Any = None,
                 tools: list[Callable[..., Any]] | None = None, rollout_func: Callable[..., Any] | None = None,
                 environment_factory: Any = None, rlhf: dict[str, Any] | None = None) -> None:
        from ..config.loading import merge
        from .trl_rollouts import RolloutTrainer, TRLRollouts

        model = _model_folder(model)
        _refuse_hooks(callbacks, optimizers)

        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)} if args is not None else {}
        defaults = grpo_defaults()
        fields = {k: v for k, v in fields.items() if k in defaults and v != defaults[k]}
        raw, self.notes = from_grpo_fields(fields)
        _set(raw, "model.path", str(model))
        funcs = [] if reward_funcs is None else (list(reward_funcs) if isinstance(reward_funcs, (list, tuple))
                                                 else [reward_funcs])
        funcs = _reward_models(funcs, raw)
        self.plugins = [f.rpartition(".")[0] for f in funcs if isinstance(f, str)]
        callables = [f for f in funcs if not isinstance(f, str)]
        from ..rewards.callables import component_name

        names = [f.rpartition(".")[2] if isinstance(f, str) else component_name(f.__name__) for f in funcs]
        n = int(raw.get("generation", {}).get("n_samples_per_prompt", 8))
        self.rollouts = TRLRollouts(tools, environment_factory, rollout_func, RolloutTrainer(args, n))
        if self.rollouts.factories and self.rollouts.owns_reward():
            names.append("env_reward")  # TRL adds the environment's get_reward as a reward source
        if not names and not raw.get("reward", {}).get("models"):
            raise ConfigError("no reward source: pass reward_funcs, or an environment_factory whose environment "
                              "defines get_reward")
        _set(raw, "reward.functions", names)
        if peft_config is not None:
            raw = merge(raw, {"lora": _peft_to_lora(peft_config, fields.get("output_dir") or "trainer_output")})
        if self.rollouts.factories:  # TRL's max_completion_length bounds a whole multi-turn trajectory
            _set(raw, "env.max_total_tokens", int(raw.get("generation", {}).get("max_new_tokens", 256)))
        self.raw = merge(merge(raw, self.rollouts.config()), rlhf or {})
        self.rewards = TRLRewards(callables) if callables else None
        if eval_dataset is not None:  # held-out prompts, evaluated before the first step and after the last
            self.raw = merge(self.raw, {"eval": {"enabled": True, "path": _eval_file(eval_dataset, fields)}})
        self.rows = None if train_dataset is None else [dict(r) for r in train_dataset]
        self.model_path, self.run_dir, self.args, self._tokenizer = str(model), None, args, processing_class
        template = _own_template(processing_class, self.model_path)
        if template is not None and not self.raw.get("data", {}).get("chat_template"):  # open-r1's --chat_template
            self.raw = merge(self.raw, {"data": {"chat_template": template}})

    def train(self, resume_from_checkpoint: str | bool | None = None) -> Any:
        """Train through the public Python API (:func:`rlhf_plugins.api.train`); returns what TRL's
        ``train()`` does (``TrainOutput(global_step, training_loss, metrics)``); the run directory is
        ``self.run_dir``, the trained policy ``self.model`` afterwards. ``resume_from_checkpoint``: a run
        directory or checkpoint folder, or True for the newest run under ``output_dir``, as in TRL."""
        from rich.console import Console

        from ..api import train
        from .trl_state import train_output

        console = Console()
        for note in self.notes:
            console.print(f"[yellow]note:[/] {note}")
        inline = [("trl_rewards", self.rewards)] if self.rewards is not None else []
        if self.rollouts.factories or self.rollouts.rollout_func is not None:
            inline.append(("trl_rollouts", self.rollouts))
        if resume_from_checkpoint:
            steps = self.raw.get("train", {}).get("steps")  # a larger max_steps extends the run, as in TRL
            target = _resume_target(resume_from_checkpoint, self.raw)
            self.run_dir = train({"train": {"steps": steps}} if steps else None, plugins=self.plugins, inline=inline,
                                 rows=self.rows, console=console, resume=target)
        else:
            self.run_dir = train(self.raw, plugins=self.plugins, inline=inline, rows=self.rows, console=console)
        return train_output(self.run_dir)

    @property
    def state(self) -> Any:
        """TRL's ``trainer.state``: ``global_step``, ``max_steps`` and ``log_history`` (one dict per step)."""
        from .trl_state import trainer_state

        return trainer_state(self.run_dir, self.raw)

    @property
    def model(self) -> Any:
        """The trained policy (``final/``), loaded with transformers once per run (before training: the
        initial one), so that ``trainer.model.config`` edits stick as on TRL's trainer."""
        from transformers import AutoModelForCausalLM

        path = str(self.run_dir / "final") if self.run_dir else self.model_path
        if getattr(self, "_loaded", (None, None))[0] != path:
            self._loaded = (path, AutoModelForCausalLM.from_pretrained(path))
        return self._loaded[1]

    @property
    def processing_class(self) -> Any:
        """The tokenizer given to the trainer, else the model folder's."""
        from transformers import AutoTokenizer

        return self._tokenizer if self._tokenizer is not None else AutoTokenizer.from_pretrained(self.model_path)

    def save_model(self, output_dir: str | None = None) -> None:
        """Copy the trained policy (``final/``: weights, config, tokenizer; a LoRA run's adapter) to
        ``output_dir`` (default: GRPOConfig.output_dir), as TRL's ``save_model`` writes it."""
        import shutil

        if self.run_dir is None:
            raise ConfigError("save_model() before train(): there is no trained model yet")
        shutil.copytree(self.run_dir / "final", Path(output_dir or self.output_dir), dirs_exist_ok=True)
