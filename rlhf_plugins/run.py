"""``rlhf train`` after validation: load data, create the run directory, train, save.

On a user error during the run (a reward that raises, weights that do not fit)
the run directory is removed, so nothing half-written looks like a result.
A finished run holds ``summary.json``; an interrupted one does not.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from .config import Config
from .errors import ConfigError, UsageError
from .manager import RLHFPluginManager
from .validate import Plan


def quiet_libraries() -> None:
    import os

    import torch
    import transformers

    if not torch.cuda.is_available():  # DeepSpeed (pulled in by transformers) would probe and warn
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def make_run_dir(config: Config) -> Path:
    base = Path(config.train.output_dir).expanduser()
    name = config.train.run_name or f"{config.algo.advantage.estimator}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = base / name
    if run_dir.exists():
        if config.train.run_name:
            raise ConfigError(f"run directory '{run_dir}' already exists; choose another --train.run_name")
        suffix = 1
        while (base / f"{name}-{suffix}").exists():
            suffix += 1
        run_dir = base / f"{name}-{suffix}"
    run_dir.mkdir(parents=True)
    return run_dir


def run_training(config: Config, pm: RLHFPluginManager, plan: Plan, console: Console,
                 rows: list[dict[str, Any]] | None = None) -> Path:
    from transformers import AutoTokenizer

    from .data import load_prompts
    from .loop import Trainer, write_json
    from .runlog import MetricsLog, StepProgress
    from .tiny_model import default_model_path

    quiet_libraries()
    model_path = config.model.path or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = load_prompts(config.data, tokenizer, rows=rows)
    run_dir = make_run_dir(config)
    (run_dir / "config.yaml").write_text(config.to_yaml())
    console.print(
        f"run directory: [bold]{escape(str(run_dir))}[/]  prompts: {len(prompts)}  model: {escape(model_path)}"
    )
    trainer = Trainer(config, pm, plan, prompts, tokenizer, model_path)
    log: MetricsLog | None = None
    step: int | None = None
    try:
        trainer.setup()
        for where, what in trainer.placement.describe().items():
            console.print(f"  {escape(where)}: {escape(what)}")
        log = MetricsLog(run_dir)
        pm.notify("rlhf_before_train", config=config, run_dir=run_dir)
        with StepProgress(config.train.steps, console, enabled=config.train.progress) as progress:
            for step in range(config.train.steps):
                metrics = trainer.step(step)
                log.log(step, metrics)
                pm.notify("rlhf_after_step", step=step, metrics=metrics)
                progress.update(step + 1, metrics)
        step = None
        final = run_dir / "final"
        if config.train.save_final:
            trainer.save_final(final)
        summary = trainer.summary()
        summary["final_model"] = str(final) if config.train.save_final else None
        write_json(run_dir / "summary.json", summary)
        console.print(
            f"mean reward: first 10% of steps {summary['reward_first_10pct']:.3f} -> last 10% "
            f"{summary['reward_last_10pct']:.3f} ({summary['reward_gain']:+.3f}); "
            f"{summary['seconds_per_step']:.2f} s/step; policy saved to {summary['final_model']}"
        )
        pm.notify("rlhf_after_train", run_dir=run_dir, metrics=summary)
        return run_dir
    except BaseException as exc:
        pm.notify("rlhf_on_error", step=step, error=exc)
        if isinstance(exc, UsageError):
            if log is not None:
                log.close()
                log = None
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        if log is not None:
            log.close()
        trainer.shutdown()
