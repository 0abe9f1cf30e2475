"""``rlhf train`` after validation: load data, create (or continue) the run directory, train,
checkpoint, save.

One rule for failures: before the first step completes, a failed new run leaves nothing behind
(the run directory is removed); once a step has completed, the run is kept -- metrics, the latest
checkpoint (plus one of the failing step when it failed before changing any weights) -- and the
error says how to resume. SIGINT / SIGTERM finish the current step, write a checkpoint and stop
with 130 / 143 (:mod:`.stopping`). A finished run holds ``summary.json``.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from ..config.schema import Config
from ..config.validate import Plan
from ..core.manager import RLHFPluginManager
from ..errors import ConfigError, Interrupted, RoleFailed, UsageError
from . import checkpoint
from .compile_failure import explain as explain_compile
from .compile_failure import is_compile_failure
from .heldout import eval_due, make_evaluator, run_eval
from .out_of_memory import OutOfMemory, explain, is_out_of_memory
from .runlog import is_eval_row, make_run_dir, quiet_libraries
from .stopping import STATUS, StopRequests, recover, resume_hint, save_failed_step, write_status


def check_lengths(config: Config, plan: Plan, prompts: Any, budget_key: str = "generation.max_new_tokens",
                  budget: int | None = None) -> None:
    """The longest prompt plus the completion budget must fit the engine, before anything starts."""
    limit = plan.engine.max_length(config) if plan.engine.max_length is not None else None
    longest = max(len(p) for p in prompts.prompt_ids)
    budget = config.generation.max_new_tokens if budget is None else budget
    need = longest + budget
    if limit is not None and need > limit:
        raise ConfigError(f"{plan.engine.max_length_key or 'the engine'} ({limit}) is shorter than the longest prompt "
                          f"({longest} tokens) plus {budget_key} ({budget}); "
                          f"raise it to at least {need} or lower --data.max_prompt_tokens")


def load_data(config: Config, plan: Plan, tokenizer: Any, rows: list[dict[str, Any]] | None = None) -> tuple[Any, Any]:
    """(training prompts, held-out prompts or None), both checked against the engine's length."""
    import dataclasses

    from ..data.prompts import (
        DEFAULT_DATA,
        SPLIT,
        eval_source,
        first_rows,
        load_prompts,
        read_rows,
        split_rows,
        use_chat_template,
    )

    use_chat_template(tokenizer, config.data)  # before any prompt is rendered
    source = eval_source(config, rows_given=rows is not None)
    d, held, name = config.data, None, None
    if rows is None:  # the first max_samples rows of each dataset, mixed by data.probs
        name = d.path or DEFAULT_DATA
        rows = read_rows(name, d.probs, config.train.seed, d.max_samples)
    else:
        rows = first_rows(rows, d.max_samples)
    if source == SPLIT:  # held-out rows are split off the data as it is
        rows, held_rows = split_rows(rows, config.eval.split, config.train.seed)
        held = load_prompts(d, tokenizer, rows=held_rows, name=name)
    prompts = load_prompts(d, tokenizer, rows=rows, name=name)
    if source not in (None, SPLIT):
        held = load_prompts(dataclasses.replace(config.data, path=source), tokenizer)
    if plan.environment is not None or config.env.column in prompts.columns:  # multi-turn: the trajectory budget
        check_lengths(config, plan, prompts, "env.max_total_tokens", config.env.max_total_tokens)
    else:
        check_lengths(config, plan, prompts)
    if held is not None:
        held = held.head(config.eval.max_prompts)
        check_lengths(config, plan, held, "eval.max_new_tokens",
                      config.eval.max_new_tokens or config.generation.max_new_tokens)
    return prompts, held


def plan_memory(config: Config, plan: Plan, console: Console, prompt_tokens: int | None = None) -> Any:
    """Print the memory plan (each role's analytic need, the node's memory) and refuse a layout whose
    minimum cannot fit, before any role starts."""
    from .memory_plan import memory_plan, show

    mplan = memory_plan(config, plan, prompt_tokens)
    show(mplan, console)
    mplan.check()
    return mplan


def run_training(config: Config, pm: RLHFPluginManager, plan: Plan, console: Console,
                 rows: list[dict[str, Any]] | None = None, resume: tuple[Path, Path] | None = None) -> Path:
    """Train into a new run directory, or continue ``resume = (run directory, checkpoint folder)``."""
    from transformers import AutoTokenizer

    from ..data.sampler import steps_for_episodes
    from ..models.tiny_model import default_model_path
    from .loop import Trainer

    quiet_libraries()
    model_path = config.model.path or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=config.model.trust_remote_code)
    prompts, held = load_data(config, plan, tokenizer, rows)
    t = config.train
    if t.episodes and not plan.steps_given:  # passes over the prompts: the steps, now that they are counted
        t.steps = steps_for_episodes(t.episodes, len(prompts), t.prompts_per_step)
    mplan = plan_memory(config, plan, console, max(len(p) for p in prompts.prompt_ids))
    run_dir = open_run_dir(config, resume)
    console.print(
        f"run directory: [bold]{escape(str(run_dir))}[/]  prompts: {len(prompts)}  steps: {t.steps}  "
        f"model: {escape(model_path)}",
        soft_wrap=True,
    )
    trainer = Trainer(config, pm, plan, prompts, tokenizer, model_path)
    trainer.memory_plan = mplan
    return TrainingRun(trainer, run_dir, console, held, resume).execute()


def open_run_dir(config: Config, resume: tuple[Path, Path] | None) -> Path:
    """A new run directory holding the run's config, or the resumed one, no longer marked as ended."""
    t = config.train
    if resume is None:
        run_dir = make_run_dir(t.output_dir, t.run_name, config.algo.advantage.estimator)
        (run_dir / "config.yaml").write_text(config.to_yaml())
        return run_dir
    for name in ("summary.json", STATUS):  # the run goes on: no longer finished, failed or interrupted
        (resume[0] / name).unlink(missing_ok=True)
    return resume[0]


class TrainingRun:
    """One run from its roles' start to its summary: the trainer, its run directory and metrics log,
    held-out evaluation, checkpoints, restarts after a role failure, and how a failure ends it."""

    def __init__(self, trainer: Any, run_dir: Path, console: Console, held: Any,
                 resume: tuple[Path, Path] | None) -> None:
        self.trainer, self.run_dir, self.console, self.held, self.resume = trainer, run_dir, console, held, resume
        self.config, self.pm = trainer.config, trainer.pm
        self.stop = StopRequests(console)
        self.log: Any = None
        self.recoverable = False

    def execute(self) -> Path:
        t = self.config.train
        try:
            with self.stop:
                start = self.start()
                self.train(start)
                if start < t.steps or not checkpoint.complete(self.run_dir):
                    self.trainer.save_checkpoint(self.run_dir, t.keep_checkpoints)
            return self.finish()
        except BaseException as exc:
            known = explain_compile(exc, self.config) if is_compile_failure(exc) and not is_out_of_memory(exc) else None
            self.fail(known or exc)
            if known is not None:
                raise known from exc
            raise
        finally:
            if self.log is not None:
                self.log.close()
            self.trainer.shutdown()

    def start(self) -> int:
        """Start every role, load the checkpoint to resume from, evaluate the starting policy; the
        step to begin with."""
        from .runlog import MetricsLog, TaskProgress

        trainer, run_dir, t = self.trainer, self.run_dir, self.config.train
        trainer.setup(resuming=self.resume is not None)
        for where, what in trainer.placement.describe().items():
            self.console.print(f"  {escape(where)}: {escape(what)}")
        start = 0
        if self.resume is not None:
            start = trainer.load_checkpoint(self.resume[1])
            self.console.print(f"resumed from {escape(str(self.resume[1]))} after step {start}")
        self.log = MetricsLog(run_dir, start)
        trainer.history = [r for r in self.log.kept if "reward/mean" in r]
        trainer.eval_history = [r for r in self.log.kept if is_eval_row(r)]
        self.recoverable = callable(getattr(trainer.placement, "recover", None)) and \
            getattr(trainer.placement, "max_restarts", 0) > 0
        if self.recoverable and not checkpoint.complete(run_dir):
            trainer.save_checkpoint(run_dir, t.keep_checkpoints)  # a state to go back to after a fault
        self.pm.notify("rlhf_before_train", config=self.config, run_dir=run_dir)
        if self.held is not None:
            trainer.evaluator = make_evaluator(self.config, self.pm, trainer.tokenizer, trainer.engine,
                                               trainer.reward, self.held, trainer.env_runner)
            if start == 0:
                with TaskProgress(self.console if t.progress else None, "eval", "prompts") as bar:
                    run_eval(trainer, run_dir, self.log, self.console, bar)
        return start

    def train(self, start: int) -> None:
        """Steps until ``train.steps``; after a role failure (placements that restart roles) the
        run goes back to its latest checkpoint and goes on."""
        from .runlog import StepProgress

        t = self.config.train
        restarts, step = 0, start
        with StepProgress(t.steps, self.console, enabled=t.progress, start=start) as progress:
            while step < t.steps:
                try:
                    self.one_step(step, restarts, progress)
                    step += 1
                except RoleFailed as exc:
                    if not self.recoverable:
                        raise
                    restarts += 1
                    step = recover(self.trainer, self.run_dir, self.log, self.console, exc)

    def one_step(self, step: int, restarts: int, progress: Any) -> None:
        """A step, its metrics and hooks, then what is due after it: evaluation, a stop request, a checkpoint."""
        trainer, run_dir, t = self.trainer, self.run_dir, self.config.train
        metrics = trainer.step(step)
        if restarts:
            metrics["fault/restarts"] = float(restarts)
        self.log.log(step, metrics, trainer.samples)
        self.pm.notify("rlhf_after_step", step=step, metrics=metrics)
        if trainer.samples:
            self.pm.notify("rlhf_after_samples", step=step, samples=trainer.samples)
        progress.update(step + 1, metrics, trainer.samples[: t.print_samples])
        done = step + 1
        if self.held is not None and eval_due(self.config, done):
            run_eval(trainer, run_dir, self.log, self.console, lambda d, n: progress.phase(f"eval {d}/{n}"))
            progress.phase("")
        if self.stop.signum is not None:
            trainer.save_checkpoint(run_dir, t.keep_checkpoints)
            raise Interrupted(f"interrupted at step {done}; {resume_hint(run_dir)}", self.stop.exit_code)
        if t.save_every and done % t.save_every == 0 and done < t.steps:
            trainer.save_checkpoint(run_dir, t.keep_checkpoints)

    def finish(self) -> Path:
        """Save the final policy, write and print the summary."""
        from .state import print_summary, write_json

        t, run_dir = self.config.train, self.run_dir
        final = run_dir / "final"
        if t.save_final:
            self.trainer.save_final(final)
        summary = self.trainer.summary()
        summary["final_model"] = str(final) if t.save_final else None
        write_json(run_dir / "summary.json", summary)
        print_summary(self.console, summary, run_dir)
        self.pm.notify("rlhf_after_train", run_dir=run_dir, metrics=summary)
        return run_dir

    def fail(self, exc: BaseException) -> None:
        """Record how the run ended and keep what is worth keeping; raises the error to show, or
        returns for the caller to re-raise ``exc`` itself."""
        trainer, run_dir, keep = self.trainer, self.run_dir, self.config.train.keep_checkpoints
        self.pm.notify("rlhf_on_error", step=trainer.step_count if trainer.phase != "idle" else None, error=exc)
        if self.log is not None:
            self.log.close()
            self.log = None
        steps_done = trainer.step_count
        if self.resume is not None and steps_done == 0:  # failed before its checkpoint was loaded: still its steps
            steps_done = next((step for step, path in checkpoint.complete(run_dir)
                               if path.resolve() == self.resume[1].resolve()), 0)
        if isinstance(exc, Interrupted):
            write_status(run_dir, "interrupted", steps_done, str(exc))
            return
        if not isinstance(exc, KeyboardInterrupt) and is_out_of_memory(exc):
            self.fail_out_of_memory(exc)
        if steps_done == 0 and self.resume is None:
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing of value was made
            return
        save_failed_step(trainer, run_dir, keep)
        interrupted = isinstance(exc, KeyboardInterrupt)
        write_status(run_dir, "interrupted" if interrupted else "failed", steps_done,
                     "KeyboardInterrupt" if interrupted else f"{type(exc).__name__}: {exc}".splitlines()[0])
        if isinstance(exc, UsageError):
            raise type(exc)(f"{exc}; the run is kept in {run_dir} (last complete step {steps_done}); after the fix, "
                            f"{resume_hint(run_dir)}") from exc
        if interrupted:
            when = f"during step {steps_done + 1}" if trainer.phase != "idle" else f"after step {steps_done}"
            found = checkpoint.complete(run_dir)
            since = f" (from the checkpoint of step {found[-1][0]})" if found else ""
            raise Interrupted(f"interrupted {when}; {resume_hint(run_dir)}{since}", self.stop.exit_code) from None

    def fail_out_of_memory(self, exc: BaseException) -> None:
        """One line naming the role that ran out, its peak and what to change; the run directory is
        kept to say so."""
        trainer, run_dir = self.trainer, self.run_dir
        oom = explain(exc, trainer.memory_plan, trainer.history, trainer.plan.placement.same_process)
        write_status(run_dir, "failed", trainer.step_count, str(oom))
        if trainer.step_count:
            save_failed_step(trainer, run_dir, self.config.train.keep_checkpoints)
        raise OutOfMemory(f"{oom}; status in {run_dir / STATUS}", oom.role, oom.peak_gb) from exc

