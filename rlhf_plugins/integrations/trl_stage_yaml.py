"""TRL's YAML files (``trl sft`` / ``reward`` / ``dpo`` / ``kto`` / ``distillation`` / ``grpo --config FILE``): the
fields of TRL's ``ModelConfig`` every such file may hold (the model's dtype, PEFT with ``use_peft``) on our keys
(:func:`model_fields`, shared with ``rlhf train --trl-config``), and a stage's file as a stage config
(:func:`from_trl_stage_yaml`): the script's model, dataset and bookkeeping on ours, every other field of
TRL's config under ``trl:``, checked against the installed TRL when the stage starts."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config.loading import set_dotted
from ..errors import ConfigError

#: TRL ModelConfig's PEFT fields (read with use_peft) -> our keys
PEFT = {"lora_r": "lora.rank", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
        "lora_target_modules": "lora.target_modules"}
#: PEFT settings of ModelConfig that a plain LoRA cannot hold (a PEFT adapter_config.json can), with use_peft
ADAPTER_ONLY = {"use_rslora": "rsLoRA", "use_dora": "DoRA", "lora_modules_to_save": "modules_to_save"}
#: quantised loading, which this project does not do
QUANTISED = {"load_in_4bit": "4-bit loading (QLoRA)", "load_in_8bit": "8-bit loading"}
MODEL_KEYS = (*PEFT, *ADAPTER_ONLY, *QUANTISED, "dtype", "torch_dtype", "trust_remote_code")
#: TRL script fields of a stage's file -> our stage keys
SCRIPT = {"model_name_or_path": "model.path", "dataset_name": "data.path", "output_dir": "train.output_dir",
          "run_name": "train.run_name", "seed": "train.seed", "teacher_model_name_or_path": "model.teacher"}
#: fields that change nothing here, and why (one note each)
IGNORED = {
    "dataset_train_split": "dataset_name is read as a local file or folder",
    "dataset_test_split": "held-out rows are data.eval_path or data.eval_split",
    "dataset_config": "dataset_name is read as a local file or folder",
    "attn_implementation": "transformers' default attention (SDPA) runs",
    "report_to": "metrics go to the run directory's metrics.jsonl and TensorBoard",
    "logging_dir": "logs live in the run directory",
    "save_strategy": "final/ is always written",
    "use_cpu": "the device is chosen by what the machine has",
    "disable_tqdm": "see --train.progress",
    "model_revision": "model_name_or_path is a local folder",
    "teacher_model_revision": "teacher_model_name_or_path is a local folder",
    "lora_task_type": "the task follows the model",
    "max_prompt_length": "TRL 1.x's trainers bound prompt and answer together by max_length (truncation_mode "
                         "says which end is cut)",
    "max_completion_length": "TRL 1.x's trainers bound prompt and answer together by max_length",
}
#: fields of earlier TRL / transformers releases that older stage files still hold -> today's field
LEGACY = {"warmup_ratio": ("warmup_steps", "transformers 5 reads a warmup_steps below 1 as the ratio"),
          "max_seq_length": ("max_length", "TRL renamed it")}
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "float32": "float32", "fp32": "float32"}


def model_fields(data: dict[str, Any], raw: dict[str, Any], notes: list[str], remote_code: str | None) -> None:
    """Pops TRL ``ModelConfig``'s fields from ``data`` onto ``raw``: ``dtype`` / ``torch_dtype`` as
    ``model.dtype`` (``auto``: the config's own), PEFT's as ``lora.*`` when ``use_peft`` is on (left
    unused otherwise, as TRL leaves them), ``trust_remote_code`` as ``remote_code`` (None: noted)."""
    peft = bool(data.pop("use_peft", False))
    for key in [k for k in data if k in MODEL_KEYS]:
        value = data.pop(key)
        if key in PEFT and peft:
            set_dotted(raw, PEFT[key], [value] if key == "lora_target_modules" and isinstance(value, str) else value)
        elif key in ADAPTER_ONLY and value and peft:
            raise ConfigError(f"TRL field '{key}' ({ADAPTER_ONLY[key]}) has no plain-field equivalent here; put it in "
                              "a PEFT adapter_config.json and give it as --lora.config")
        elif key in QUANTISED and value:
            raise ConfigError(f"TRL field '{key}': {QUANTISED[key]} is not supported")
        elif key in ("dtype", "torch_dtype") and str(value) in DTYPES:
            set_dotted(raw, "model.dtype", DTYPES[str(value)])
        elif key == "trust_remote_code" and value:
            if remote_code is None:
                notes.append("TRL field 'trust_remote_code' is ignored: stage models load without remote code")
            else:
                set_dotted(raw, remote_code, True)


def from_trl_stage_yaml(path: str | Path) -> tuple[dict[str, Any], list[str]]:
    """The raw stage config of a TRL YAML, and one note per field that changes nothing here."""
    from ..config.loading import load_yaml

    data = dict(load_yaml(path))
    raw: dict[str, Any] = {}
    notes: list[str] = []
    model_fields(data, raw, notes, None)
    for key, value in data.items():
        if key in SCRIPT:
            set_dotted(raw, SCRIPT[key], value)
        elif key in ("bf16", "fp16"):
            if value:
                set_dotted(raw, "model.dtype", "bfloat16" if key == "bf16" else "float16")
        elif key in LEGACY:
            field, why = LEGACY[key]
            set_dotted(raw, f"trl.{field}", value)
            notes.append(f"TRL field '{key}' becomes trl.{field} ({why})")
        elif key in IGNORED:
            notes.append(f"TRL field '{key}' is ignored: {IGNORED[key]}")
        else:
            set_dotted(raw, f"trl.{key}", value)
    return raw, notes
