"""TRL integration: a TRL user's GRPO config, reward functions and script, on our loop.

* :func:`from_grpo_fields` (:mod:`.trl_config`) maps ``GRPOConfig`` fields to our config and says which
  fields it ignores and why; a field that changes training and has no equivalent
  is an error (``from_trl_fields(fields, "rloo")``: ``RLOOConfig``'s).
* ``rlhf train --trl-config grpo.yaml`` reads a YAML of ``GRPOConfig`` fields (plus
  TRL's ``model_name_or_path``, ``dataset_name`` and ``reward_funcs``).
* :class:`GRPOTrainer` takes the arguments of ``trl.GRPOTrainer`` (:class:`RLOOTrainer`: ``trl.RLOOTrainer``'s);
  a script changes its import and adds ``rlhf={"placement": {"strategy": "ray"}}`` to run on Ray.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .trl_config import TRAINERS, _set, from_grpo_fields, from_trl_fields, from_trl_yaml, grpo_defaults, trl_defaults
from .trl_inputs import (
    changed_in_memory,
    eval_file,
    model_folder,
    own_template,
    peft_model_of,
    peft_to_lora,
    refuse_hooks,
    resume_target,
    reward_models,
    save_adapter,
    save_initial_model,
)
from .trl_state import AfterTraining

__all__ = ["GRPOTrainer", "RLOOTrainer", "TRLRewards", "from_grpo_fields", "from_trl_fields", "from_trl_yaml",
           "grpo_defaults"]

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


class GRPOTrainer(AfterTraining):
    """``trl.GRPOTrainer``'s arguments, rlhf-plugins' loop (local or Ray).

    ``model`` is a local model folder, ``reward_funcs`` callables (TRL's signature, sync or
    async) or ``"module.function"`` strings, ``args`` a ``trl.GRPOConfig``, ``train_dataset``
    a ``datasets.Dataset`` or a list of rows with a ``prompt`` column, ``peft_config`` a
    ``peft.LoraConfig``; ``tools``, ``environment_factory`` (one or a dict) and ``rollout_func``
    as TRL takes them (:mod:`rlhf_plugins.integrations.trl_rollouts`). ``rlhf`` overrides our
    config (e.g. the placement).
    """

    #: the TRL trainer whose config ``args`` is (:data:`.trl_config.TRAINERS`)
    TRAINER = "grpo"

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: Any = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: list[Callable[..., Any]] | None = None,
                 rollout_func: Callable[..., Any] | None = None, environment_factory: Any = None,
                 rlhf: dict[str, Any] | None = None) -> None:
        from ..config.loading import merge
        from .trl_rollouts import RolloutTrainer, TRLRollouts

        refuse_hooks(callbacks, optimizers, quantization_config)
        fields = self._fields(args)
        peft_model = peft_model_of(model, peft_config)
        loaded, model = model, model_folder(model)
        changed = None if peft_model is not None or isinstance(loaded, (str, Path)) else (
            changed_in_memory(loaded, model, processing_class))
        raw, self.notes = from_trl_fields(fields, self.TRAINER)
        _set(raw, "model.path", str(model))
        funcs = [] if reward_funcs is None else (list(reward_funcs) if isinstance(reward_funcs, (list, tuple))
                                                 else [reward_funcs])
        funcs = reward_models(funcs, raw)
        self.plugins = [f.rpartition(".")[0] for f in funcs if isinstance(f, str)]
        callables = [f for f in funcs if not isinstance(f, str)]
        from ..rewards.callables import callable_name, component_name

        names = [f.rpartition(".")[2] if isinstance(f, str) else component_name(callable_name(f)) for f in funcs]
        trl_names = [callable_name(f) for f in callables]
        #: our reward names -> TRL's, where they differ (a callable class's, a capitalised function's)
        self.reward_names = {component_name(n): n for n in trl_names if component_name(n) != n}
        n = int(raw.get("generation", {}).get("n_samples_per_prompt", 8))
        self.rollouts = TRLRollouts(tools, environment_factory, rollout_func, RolloutTrainer(args, n))
        if self.rollouts.factories and self.rollouts.owns_reward():
            names.append("env_reward")  # TRL adds the environment's get_reward as a reward source
        if not names and not raw.get("reward", {}).get("models"):
            raise ConfigError("no reward source: pass reward_funcs, or an environment_factory whose environment "
                              "defines get_reward")
        _set(raw, "reward.functions", names)
        self.rows = None if train_dataset is None else [dict(r) for r in train_dataset]
        visual = sorted({k for r in (self.rows or [])[:1] for k in ("image", "images") if r.get(k) is not None})
        if visual:  # TRL hands these columns to a vision-language model; here they would be silently unused
            raise ConfigError(f"train_dataset has an '{visual[0]}' column, which TRL feeds to a vision-language model; "
                              "training here is text-only: drop the column (or rename it if it holds no image)")
        # held-out prompts, evaluated before the first step and after the last (eval_file refuses before it writes)
        held_out = {} if eval_dataset is None else {"eval": {"enabled": True, "path": eval_file(eval_dataset, fields)}}
        out = fields.get("output_dir") or "trainer_output"
        if changed is not None:  # written last, as below: the model as the script left it, as TRL trains it
            model = save_initial_model(loaded, processing_class, model, out)
            _set(raw, "model.path", model)
            self.notes.append(f"model: {changed}: saved as {model} and trained from there")
        if peft_config is not None or peft_model is not None:  # written last: a refused trainer leaves nothing
            raw = merge(raw, {"lora": save_adapter(peft_model, out) if peft_model is not None
                              else peft_to_lora(peft_config, out)})
        if self.rollouts.factories:  # TRL's max_completion_length bounds a whole multi-turn trajectory
            _set(raw, "env.max_total_tokens", int(raw.get("generation", {}).get("max_new_tokens", 256)))
        self.raw = merge(merge(merge(raw, self.rollouts.config()), rlhf or {}), held_out)
        self.rewards = TRLRewards(callables) if callables else None
        self.model_path, self.run_dir, self.args, self._tokenizer = str(model), None, args, processing_class
        template = own_template(processing_class, self.model_path)
        if template is not None and not self.raw.get("data", {}).get("chat_template"):  # open-r1's --chat_template
            self.raw = merge(self.raw, {"data": {"chat_template": template}})

    def _fields(self, args: Any) -> dict[str, Any]:
        """The fields ``args`` changes from TRL's defaults (a subclass's own fields, open-r1's, left out); args
        of another trainer's config is one line."""
        if args is None:
            return {}
        import trl

        config = TRAINERS[self.TRAINER][0]
        if not isinstance(args, getattr(trl, config)):
            raise ConfigError(f"{type(self).__name__} takes a trl.{config} as args; got {type(args).__name__}")
        defaults = trl_defaults(self.TRAINER)
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
                if f.name in defaults and getattr(args, f.name) != defaults[f.name]}

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
            target = resume_target(resume_from_checkpoint, self.raw)
            self.run_dir = train({"train": {"steps": steps}} if steps else None, plugins=self.plugins, inline=inline,
                                 rows=self.rows, console=console, resume=target)
        else:
            self.run_dir = train(self.raw, plugins=self.plugins, inline=inline, rows=self.rows, console=console)
        return train_output(self.run_dir)

    @property
    def state(self) -> Any:
        """TRL's ``trainer.state``: ``global_step``, ``max_steps`` and ``log_history`` (one dict per step)."""
        from .trl_state import trainer_state

        return trainer_state(self.run_dir, self.raw, self.reward_names)

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


class RLOOTrainer(GRPOTrainer):
    """``trl.RLOOTrainer``'s arguments (``args`` a ``trl.RLOOConfig``), rlhf-plugins' loop: the leave-one-out
    baseline, PPO's clip on each completion's whole ratio, the KL to the reference in the reward (beta, k1
    summed over the completion), ``normalize_advantages`` and ``reward_clip_range`` as TRL runs them
    (:func:`.trl_algorithm.rloo_algorithm`). The rest -- rewards, datasets, peft_config, ``rlhf=``, what
    ``train()`` returns -- as :class:`GRPOTrainer`."""

    TRAINER = "rloo"

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: Any = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, rlhf: dict[str, Any] | None = None) -> None:
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, callbacks, optimizers, quantization_config, peft_config, rlhf=rlhf)
