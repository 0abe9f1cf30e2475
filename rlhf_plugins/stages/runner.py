"""Run a stage before RL with TRL's trainer under this project's conventions: the run directory
(``config.yaml``, ``metrics.jsonl``, ``tensorboard/``, ``final/``, ``summary.json``), the progress
bar, one-line errors (a failure leaves no run directory), ``--lora.*`` through PEFT, and a
held-out figure: SFT exact-match accuracy, RM pairwise accuracy, DPO preference accuracy and
reward margin, KTO's reward margin and KL (DPO and KTO with the embedded data: exact-match accuracy too), the
divergence of a distilled student from its teacher on held-out prompts (with the embedded data: both one's
exact-match accuracy). Multi-GPU is TRL's: launch the same command under ``accelerate launch``."""
from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape

from ..models.folder import save_pretrained
from ..training.runlog import make_run_dir, quiet_libraries
from . import data as stage_data
from .config import StageConfig, check, trl_config

logger = logging.getLogger("rlhf_plugins")
TRAINERS = {"sft": "SFTTrainer", "rm": "RewardTrainer", "dpo": "DPOTrainer", "kto": "KTOTrainer",
            "distill": "DistillationTrainer"}


#: what each stage's progress shows of TRL's logs (label, TRL's metric, digits, colour)
LOSS = ("loss", "loss", 4, "yellow")
PROGRESS = {"sft": (LOSS, ("token accuracy", "mean_token_accuracy", 3, "cyan")),
            "rm": (LOSS, ("accuracy", "accuracy", 3, "cyan"), ("margin", "margin", 3, "magenta")),
            "dpo": (LOSS, ("reward accuracy", "rewards/accuracies", 3, "cyan"),
                    ("margin", "rewards/margins", 3, "magenta")),
            "kto": (LOSS, ("margin", "rewards/margins", 3, "magenta"), ("kl", "kl", 4, "cyan")),
            "distill": (LOSS, ("entropy", "entropy", 3, "cyan"), ("length", "completions/mean_length", 1, "magenta"))}


def _callback(run_dir: Path, stage: str, cfg: StageConfig, console: Console) -> Any:
    from transformers import TrainerCallback

    from ..training.memory_watch import process_memory
    from ..training.runlog import MetricsLog, StepProgress

    class RunCallback(TrainerCallback):
        """TRL's logs into metrics.jsonl / TensorBoard, its steps into our progress bar."""

        def __init__(self) -> None:
            self.log = MetricsLog(run_dir)
            self.progress: StepProgress | None = None
            self.last: dict[str, float] = {}

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.progress = StepProgress(state.max_steps, console, enabled=cfg.train.progress,
                                         columns=PROGRESS[stage]).__enter__()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            values = {k: float(v) for k, v in (logs or {}).items() if isinstance(v, (int, float))}
            self.last.update(values)
            self.log.log(state.global_step, values)
            self._show(state.global_step)  # a step's logs come after its end: its line waited for them

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            if state.global_step >= state.max_steps:  # the last step's figures are logged too
                control.should_log = True
            if not control.should_log:  # (transformers' flow callback, called first, decided) else: at its logs
                self._show(state.global_step)
            return control

        def _show(self, step: int) -> None:
            if self.progress is not None:  # mem: this process's peak, where the stage trains
                peak = process_memory()["rss_gb"]
                self.progress.update(step, {**self.last, "memory/stage_rss_gb": peak})

        def close(self) -> None:
            if self.progress is not None:
                self.progress.__exit__(None, None, None)
            self.log.close()

    return RunCallback()


def _model(stage: str, path: str, cfg: StageConfig, tokenizer: Any) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from ..models.forward import DTYPES

    dtype = DTYPES[cfg.model.dtype]
    if stage == "rm":
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype,
                                                                   trust_remote_code=False)
        model.config.pad_token_id = tokenizer.pad_token_id
        return model
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False)


def _peft(stage: str, cfg: StageConfig) -> Any:
    if cfg.lora.rank <= 0 and cfg.lora.config is None:  # none, or a trained adapter (_trainer loads it)
        return None
    from types import SimpleNamespace

    from ..builtin_plugins.lora import lora_config

    peft_config = lora_config(SimpleNamespace(section=lambda name: cfg.lora))
    peft_config.task_type = "SEQ_CLS" if stage == "rm" else "CAUSAL_LM"
    if stage == "rm":
        peft_config.modules_to_save = ["score"]
    return peft_config


def _save_final(trainer: Any, tokenizer: Any, run_dir: Path) -> Path:
    """``final/`` is always a whole model (LoRA merged in) that the next stage loads as it is;
    the adapter alone goes to ``final-adapter/``."""
    final = run_dir / "final"
    model = trainer.model
    if hasattr(model, "merge_and_unload"):
        save_pretrained(model, run_dir / "final-adapter")
        model = model.merge_and_unload()
    save_pretrained(model, final)
    tokenizer.save_pretrained(final)
    return final


def _exact_match(final: Path, rows: list[dict[str, Any]]) -> dict[str, float]:
    """The saved policy's answers to held-out prompts against their ``label``: its accuracy as RL samples it
    (temperature 1), and its greedy answer's."""
    from .heldout import evaluate_model

    figures = evaluate_model(str(final), rows, n=8)
    return {"exact_match_accuracy": figures["pass@1"], "greedy_accuracy": figures["greedy"],
            **{f"heldout/{k}": v for k, v in figures.items()}}


def _heldout(stage: str, trainer: Any, final: Path, held: list[dict[str, Any]], cfg: StageConfig) -> dict[str, float]:
    embedded = cfg.data.path is None
    if not held:
        return {}
    if stage == "sft":
        answered = [a for a in map(_prompt_and_answer, held) if a is not None]
        return _exact_match(final, answered) if answered else {}
    if stage == "rm":
        from ..models.reward_model import RewardModelScorer

        scorer = RewardModelScorer(str(final))
        chosen = scorer([r["prompt"] for r in held], [_text(r["chosen"]) for r in held])
        rejected = scorer([r["prompt"] for r in held], [_text(r["rejected"]) for r in held])
        return {"pairwise_accuracy": sum(c > r for c, r in zip(chosen, rejected)) / len(held),
                "heldout/score_margin": sum(c - r for c, r in zip(chosen, rejected)) / len(held)}
    from datasets import Dataset

    if stage == "distill":
        return _distilled(trainer, final, held, cfg.model.teacher if embedded else None)
    metrics = trainer.evaluate(eval_dataset=Dataset.from_list(held))
    if stage == "kto":  # the implied reward of the desirable answers over the undesirable ones, TRL's KL estimate
        out = {"kl": float(metrics["eval_kl"])} if "eval_kl" in metrics else {}
        if "eval_rewards/chosen" in metrics and "eval_rewards/rejected" in metrics:
            out["reward_margin"] = float(metrics["eval_rewards/chosen"]) - float(metrics["eval_rewards/rejected"])
    else:
        out = {"preference_accuracy": float(metrics["eval_rewards/accuracies"]),
               "reward_margin": float(metrics["eval_rewards/margins"])}
    if embedded:  # the embedded task's pairs hold each sum's right answer: how often the policy gives it
        answers = {str(r["prompt"]): {"prompt": r["prompt"], "label": _text(r["chosen"])} for r in held}
        out.update(_exact_match(final, list(answers.values())))
    return out


def _distilled(trainer: Any, final: Path, held: list[dict[str, Any]], teacher: str | None) -> dict[str, float]:
    """TRL's divergence (its loss, at its beta) of the student from the teacher on completions the student
    samples for held-out prompts; with the embedded data (``teacher`` given), both models' exact-match accuracy."""
    from datasets import Dataset

    metrics = trainer.evaluate(eval_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in held]))
    out = {"divergence": float(metrics["eval_loss"])}
    if teacher is not None:
        answers = [{"prompt": r["prompt"], "label": _text(r["completion"])} for r in held]
        out.update(_exact_match(final, answers))
        out["teacher_exact_match_accuracy"] = _exact_match(Path(teacher), answers)["exact_match_accuracy"]
    return out


def _trainer(stage: str, cfg: StageConfig, path: str, tokenizer: Any, args: Any, train: list[dict[str, Any]],
             callback: Any) -> Any:
    """TRL's trainer of ``stage`` on the training rows (distillation's with its teacher beside the student)."""
    import trl
    from datasets import Dataset
    from transformers import set_seed
    from transformers.trainer_callback import PrinterCallback

    set_seed(cfg.train.seed)  # a new head (the reward model's) starts the same every time
    extra = {}
    if stage == "distill":
        extra["teacher_model"] = _model(stage, str(cfg.model.teacher), cfg, tokenizer)
    if cfg.model.reference_path:  # DPO / KTO against a reference of its own (OpenRLHF's --ref_pretrain)
        extra["ref_model"] = _model(stage, cfg.model.reference_path, cfg, tokenizer)
    model = _model(stage, path, cfg, tokenizer)
    if cfg.lora.adapter:  # go on training a trained adapter, as TRL does with a PeftModel
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, cfg.lora.adapter, is_trainable=True)
    trainer = getattr(trl, TRAINERS[stage])(
        model=model, args=args, train_dataset=Dataset.from_list(train),
        processing_class=tokenizer, peft_config=_peft(stage, cfg), callbacks=[callback], **extra)
    trainer.remove_callback(PrinterCallback)  # our progress bar and metrics.jsonl say it
    return trainer


def _text(value: Any) -> str:
    return value if isinstance(value, str) else value[-1]["content"]


def _prompt_and_answer(row: dict[str, Any]) -> dict[str, Any] | None:
    """A held-out SFT row as a prompt and the answer to match: a demonstration's completion, a conversation's
    last assistant turn after the turns before it; None for plain text, which has no answer of its own."""
    if "prompt" in row:
        return {"prompt": row["prompt"], "label": _text(row["completion"])}
    turns = row.get("messages") or []
    if len(turns) > 1 and turns[-1].get("role") == "assistant":
        return {"prompt": turns[:-1], "label": turns[-1]["content"]}
    return None


def run_stage(stage: str, cfg: StageConfig, console: Console) -> Path:
    from transformers import AutoTokenizer

    from ..models.tiny_model import default_model_path
    from ..training.state import write_json

    check(cfg, stage)
    with tempfile.TemporaryDirectory() as tmp:
        trl_config(stage, cfg, tmp)  # TRL's own checks, before anything is written
    quiet_libraries()
    path = cfg.model.path or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    train, held, counts = stage_data.load(stage, cfg, tokenizer)
    run_dir = make_run_dir(cfg.train.output_dir, cfg.train.run_name, stage)
    callback = None
    try:
        args = trl_config(stage, cfg, str(run_dir / "trl"))
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        console.print(f"run directory: [bold]{escape(str(run_dir))}[/]  {stage}: {len(train)} training rows, "
                      f"{len(held)} held out  model: {escape(path)}")
        callback = _callback(run_dir, stage, cfg, console)
        trainer = _trainer(stage, cfg, path, tokenizer, args, train, callback)
        result = trainer.train()
        final = _save_final(trainer, tokenizer, run_dir)
        figures = _heldout(stage, trainer, final, held, cfg)
        callback.close()
        callback = None
        shutil.rmtree(run_dir / "trl", ignore_errors=True)
        summary = {"stage": stage, "steps": int(result.global_step), "train_loss": float(result.training_loss),
                   "training_rows": len(train), "heldout_rows": len(held), **counts, **figures,
                   "final_model": str(final)}
        write_json(run_dir / "summary.json", summary)
        keys = ("exact_match_accuracy", "greedy_accuracy", "teacher_exact_match_accuracy", "pairwise_accuracy",
                "preference_accuracy", "reward_margin", "kl", "divergence")
        shown = {k: v for k, v in summary.items() if k in keys}
        figures_line = ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in shown.items()) or "no figure"
        console.print(f"{stage}: {len(train)} rows, {summary['steps']} steps; held-out {figures_line}; "
                      f"model saved to {final}")
        return run_dir
    except BaseException:
        if callback is not None:
            callback.close()
        shutil.rmtree(run_dir, ignore_errors=True)  # a stage is short: a failed one leaves nothing
        raise
