"""What a script hands a TRL trainer -- the model, reward_funcs, peft_config, eval_dataset, hooks,
resume_from_checkpoint -- as this project takes it (:class:`.trl.GRPOTrainer` and :class:`.trl.RLOOTrainer`
call these): local folders, reward models among the functions, a LoRA config as the lora section, and
one line for what has no equivalent."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .trl_config import _set

#: LoraConfig fields the lora section holds (with what only names the task or the base)
PLAIN_LORA = {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "peft_type", "base_model_name_or_path",
              "revision", "inference_mode"}


def peft_to_lora(peft_config: Any, output_dir: str) -> dict[str, Any]:
    """A peft.LoraConfig as the lora section; one that sets more (DoRA, rsLoRA, PiSSA, modules_to_save,
    per-module ranks...) is saved whole as ``<output_dir>/peft_config/adapter_config.json`` for --lora.config."""
    from peft import LoraConfig

    defaults = LoraConfig().to_dict()  # peft_config is a LoraConfig: peft_model_of checked it
    if any(v != defaults.get(k) for k, v in peft_config.to_dict().items() if k not in PLAIN_LORA):
        folder = Path(output_dir) / "peft_config"
        peft_config.save_pretrained(str(folder))
        return {"config": str(folder.resolve())}
    targets = peft_config.target_modules
    targets = [targets] if isinstance(targets, str) else sorted(targets or [])
    return {"rank": int(peft_config.r), "alpha": float(peft_config.lora_alpha),
            "dropout": float(peft_config.lora_dropout), "target_modules": targets}


def peft_model_of(model: Any, peft_config: Any) -> Any | None:
    """The PeftModel passed as ``model`` (a LoRA adapter on its base, loaded or trained), whose adapter TRL goes
    on training and so does the run (:func:`save_adapter`); None for a plain model. One line for what cannot
    be trained here (checked before anything is written)."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return None
    from peft import LoraConfig, PeftModel

    if peft_config is not None and not isinstance(peft_config, LoraConfig):
        raise ConfigError(f"peft_config is a {type(peft_config).__name__}; rlhf-plugins trains LoRA adapters: pass a "
                          "peft.LoraConfig")
    if not isinstance(model, PeftModel):
        return None
    if peft_config is not None:
        raise ConfigError("model is a PeftModel and peft_config is given too: pass the PeftModel alone to go on "
                          "training its adapter, or its base model with peft_config for a new one")
    configs = dict(model.peft_config)
    if list(configs) != ["default"] or not isinstance(configs["default"], LoraConfig):
        kinds = ", ".join(f"{name} ({type(cfg).__name__})" for name, cfg in configs.items())
        raise ConfigError(f"model is a PeftModel with the adapters {kinds}; rlhf-plugins goes on training one LoRA "
                          "adapter, PEFT's 'default' (PeftModel.from_pretrained(base, folder) loads one so)")
    return model


def save_adapter(model: Any, output_dir: str) -> dict[str, Any]:
    """A PeftModel's adapter as ``<output_dir>/initial_adapter``: the lora section's ``adapter`` (its config
    and weights), which the run goes on training."""
    folder = Path(output_dir) / "initial_adapter"
    model.save_pretrained(str(folder))
    return {"adapter": str(folder.resolve())}


def reward_models(funcs: list[Any], raw: dict[str, Any]) -> list[Any]:
    """TRL loads a reward_funcs entry that names a model (a local folder, or a loaded model) as a sequence
    classifier: those become reward.models, TRL's reward_weights reordered to ours (functions, then
    models). Returns the other entries."""
    def folder(f: Any) -> str | None:
        if isinstance(f, str):
            if f and Path(f).is_dir():
                return str(Path(f).resolve())
            if "/" in f:  # a hub name, as TRL would download: never a 'module.function'
                raise ConfigError(f"reward_funcs entry '{f}' is not a local folder; download the reward model "
                                  f"(hf download {f} --local-dir DIR) and pass DIR")
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


def model_folder(model: Any) -> str:
    """TRL takes a model name or a loaded model: here a local folder, or a model loaded from one."""
    if isinstance(model, (str, Path)):
        return str(model)
    path = getattr(model, "name_or_path", "") or ""
    if not path or not Path(path).is_dir():
        raise ConfigError(f"model {type(model).__name__} ('{path}') is not a local folder; save it with "
                          "save_pretrained and pass the folder")
    frozen = [name for name, param in model.named_parameters() if not param.requires_grad]
    if frozen and not hasattr(model, "peft_config"):
        raise ConfigError(f"model has {len(frozen)} frozen parameters ({frozen[0]}, ...: requires_grad False), which "
                          "TRL's optimizer leaves out; rlhf-plugins trains every weight, or a LoRA adapter: unfreeze "
                          "them, or pass peft_config")
    return str(Path(path).resolve())


def changed_in_memory(model: Any, folder: str, processing_class: Any) -> str | None:
    """Why a loaded ``model`` cannot train from ``folder`` as it is, or None when it can: the script changed the
    model or the tokenizer beside it after loading them -- a tensor changed or resized (resize_token_embeddings
    after adding tokens), tokens added -- or the folder's weights are pickled, which the script loaded and runs
    do not (tensors its checkpoint names otherwise are not compared)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from ..models.folder import pickled_weights

    pickled = pickled_weights(Path(folder))
    if pickled:
        return f"loaded from pickled weights ({pickled[0]}), which runs do not load from a folder"
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if tokenizer is not None:
        saved_tokens = len(AutoTokenizer.from_pretrained(folder))
        if len(tokenizer) != saved_tokens:
            return f"its tokenizer has {len(tokenizer)} tokens, the folder's {saved_tokens} (changed after loading)"
    state = model.state_dict()
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as saved:
            for name in saved.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = state.get(name)
                if tensor is None:
                    continue
                disk = saved.get_tensor(name)
                if disk.shape != tensor.shape or not torch.equal(disk.to(tensor.dtype), tensor.detach().cpu()):
                    return f"{name} is not the folder's (changed after loading)"
    return None


def save_initial_model(model: Any, processing_class: Any, folder: str, output_dir: str) -> str:
    """A model the script changed in memory, with its tokenizer, as ``<output_dir>/initial_model``: the
    folder the run trains from (as TRL trains the object it was given)."""
    from transformers import AutoTokenizer

    from ..models.folder import save_pretrained

    out = Path(output_dir) / "initial_model"
    save_pretrained(model, out)
    tokenizer = getattr(processing_class, "tokenizer", processing_class) or AutoTokenizer.from_pretrained(folder)
    tokenizer.save_pretrained(str(out))
    return str(out.resolve())


def own_template(processing_class: Any, model_path: str) -> str | None:
    """The chat template of a tokenizer passed as ``processing_class`` where it is not the model folder's
    (scripts set one on the tokenizer they pass): None when it is the same, or there is none."""
    template = getattr(processing_class, "chat_template", None)
    if not isinstance(template, str):
        return None
    from transformers import AutoTokenizer

    return None if AutoTokenizer.from_pretrained(model_path).chat_template == template else template


def refuse_hooks(callbacks: Any, optimizers: Any, quantization_config: Any) -> None:
    """transformers' TrainerCallbacks and a ready-made optimizer belong to TRL's Trainer loop, which does
    not run here, and a quantized model (QLoRA) has no equivalent: one line each, pointing at what does the
    same."""
    if quantization_config is not None:
        raise ConfigError("quantization_config (a bitsandbytes-quantized model, QLoRA) has no equivalent here: the "
                          "model trains in --model.dtype (bf16 with bf16: true); drop quantization_config, and pass "
                          "peft_config for LoRA")
    if callbacks:
        raise ConfigError("callbacks are transformers TrainerCallbacks, which this loop does not call; write a "
                          "plugin with rlhf_after_step / rlhf_after_rollout hooks (docs/plugin_hooks.md)")
    if optimizers is not None and any(o is not None for o in optimizers):
        raise ConfigError("optimizers=(optimizer, scheduler) are built for TRL's Trainer; set GRPOConfig's optim, "
                          "learning_rate and lr_scheduler_type (or --learner.optimizer) instead")


def eval_file(eval_dataset: Any, fields: dict[str, Any]) -> str:
    """The eval_dataset's rows as ``<output_dir>/eval_dataset.jsonl`` (the run reads held-out prompts
    from a file, as it does on Ray workers). A dict of datasets (TRL evaluates each under its name) is one
    line: a run here has one held-out set."""
    import json

    if isinstance(eval_dataset, dict):  # datasets' DatasetDict is a dict too
        raise ConfigError(f"eval_dataset is a dict of datasets ({', '.join(map(str, eval_dataset))}), which TRL "
                          "evaluates one by one under their names; a run here evaluates one held-out set: pass one "
                          "dataset (concatenate them, or pick one)")
    folder = Path(fields.get("output_dir") or "trainer_output")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "eval_dataset.jsonl"
    path.write_text("".join(json.dumps(dict(row), default=str) + "\n" for row in eval_dataset))
    return str(path.resolve())


def resume_target(resume: str | bool, raw: dict[str, Any]) -> str:
    """TRL's resume_from_checkpoint: a folder, or True for the newest run under output_dir."""
    if resume is not True:
        return str(resume)
    base = Path(raw.get("train", {}).get("output_dir") or "runs")
    runs = sorted((d for d in base.glob("*") if (d / "checkpoints").is_dir()), key=lambda d: d.stat().st_mtime)
    if not runs:
        raise ConfigError(f"resume_from_checkpoint=True: no run with checkpoints under '{base}'")
    return str(runs[-1])
