"""A ``trl sft`` / ``trl reward`` / ``trl dpo`` YAML (``trl sft --config sft.yaml``) as a stage config:
TRL's script fields (model, dataset, PEFT) on our keys, the run's bookkeeping on ``train``, and every
other field of TRL's config under ``trl:``, checked against the installed TRL when the stage starts."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config.loading import set_dotted

#: TRL script / ModelConfig fields -> our stage keys
SCRIPT = {"model_name_or_path": "model.path", "dataset_name": "data.path", "output_dir": "train.output_dir",
          "run_name": "train.run_name", "seed": "train.seed", "lora_r": "lora.rank", "lora_alpha": "lora.alpha",
          "lora_dropout": "lora.dropout", "lora_target_modules": "lora.target_modules"}
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
    "trust_remote_code": "stage models load without remote code",
    "model_revision": "model_name_or_path is a local folder",
}
#: fields of earlier TRL / transformers releases that older YAML files still hold -> today's field
LEGACY = {"warmup_ratio": ("warmup_steps", "transformers 5 reads a warmup_steps below 1 as the ratio"),
          "max_seq_length": ("max_length", "TRL renamed it")}
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "float32": "float32", "fp32": "float32", "auto": None}


def from_trl_stage_yaml(path: str | Path) -> tuple[dict[str, Any], list[str]]:
    """The raw stage config of a TRL YAML, and one note per field that changes nothing here."""
    from ..config.loading import load_yaml

    data = dict(load_yaml(path))
    raw: dict[str, Any] = {}
    notes: list[str] = []
    peft = bool(data.pop("use_peft", False))
    for key in list(data):
        value = data.pop(key)
        if key in SCRIPT and (peft or not key.startswith("lora_")):
            set_dotted(raw, SCRIPT[key], [value] if key == "lora_target_modules" and isinstance(value, str)
                       else value)
        elif key.startswith("lora_") or key in ("use_rslora", "use_dora"):
            continue  # PEFT fields without use_peft: TRL leaves them unused too
        elif key in ("dtype", "torch_dtype"):
            if DTYPES.get(str(value)) is not None:
                set_dotted(raw, "model.dtype", DTYPES[str(value)])
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
