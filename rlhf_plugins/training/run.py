"""``rlhf train`` after validation: load data, create (or continue) the run directory, train,
checkpoint, save.

One rule for failures: before the first step completes, a failed new run leaves nothing behind
(the run directory is removed); once a step has completed, the run is kept -- metrics, the latest
checkpoint (plus one of the failing step when it failed before changing any weights) -- and the
error says how to resume. SIGINT / SIGTERM finish the current step, write a checkpoint and stop
with 130 / 143; a second SIGINT stops at once. A finished run holds ``summary.json``.
"""
from __future__ import annotations

import logging
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from ..config.schema import Config
from ..config.validate import Plan
from ..core.manager import RLHFPluginManager
from ..errors import ConfigError, Interrupted, RoleFailed, UsageError
from . import checkpoint
from .heldout import make_evaluator, run_eval
from .out_of_memory import OutOfMemory, explain, is_out_of_memory
from .runlog import is_eval_row, make_run_dir, quiet_libraries

logger = logging.getLogger("rlhf_plugins")
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


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

    from ..data.prompts import DEFAULT_DATA, SPLIT, eval_source, load_prompts, read_rows, split_rows

    source = eval_source(config, rows_given=rows is not None)
    held = None
    if source == SPLIT:
        rows, held_rows = split_rows(rows if rows is not None else read_rows(config.data.path or DEFAULT_DATA),
                                     config.eval.split, config.train.seed)
        held = load_prompts(config.data, tokenizer, rows=held_rows)
    prompts = load_prompts(config.data, tokenizer, rows=rows)
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


def eval_due(config: Config, done: int) -> bool:
    """Evaluate after ``done`` steps: at the end, and every ``eval.every`` steps."""
    every = config.eval.every
    return done == config.train.steps or bool(every and done % every == 0)


#: seconds a step may still take after SIGINT / SIGTERM before the run stops at once
STOP_GRACE = 10.0


class StopRequests:
    """SIGINT / SIGTERM ask the loop to stop after the current step (main thread only); a step that
    has not finished :data:`STOP_GRACE` seconds later (a stuck reward, a hung call) is interrupted, so
    ``ray job stop`` or a scheduler's SIGTERM ends the run within seconds, its status written."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._deadline: threading.Timer | None = None

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in EXIT_CODES:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        self.console.print(f"rlhf: {signal.Signals(signum).name} received: finishing this step, then saving a "
                           f"checkpoint (Ctrl-C again stops at once; so does a step still running in "
                           f"{STOP_GRACE:g} s)", highlight=False)
        import _thread

        self._deadline = threading.Timer(STOP_GRACE, _thread.interrupt_main, args=(signal.SIGINT,))
        self._deadline.daemon = True
        self._deadline.start()


def resume_hint(run_dir: Path) -> str:
    return f"resume with: rlhf train --resume {run_dir}"


def run_training(config: Config, pm: RLHFPluginManager, plan: Plan, console: Console,
                 rows: list[dict[str, Any]] | None = None, resume: tuple[Path, Path] | None = None) -> Path:
    """Train into a new run directory, or continue ``resume = (run directory, checkpoint folder)``."""
    from transformers import AutoTokenizer

    from ..models.tiny_model import default_model_path
    from .loop import Trainer
    from .runlog import MetricsLog, StepProgress, TaskProgress
    from .state import write_json

    quiet_libraries()
    model_path = config.model.path or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=config.model.trust_remote_code)
    prompts, held = load_data(config, plan, tokenizer, rows)
    mplan = plan_memory(config, plan, console, max(len(p) for p in prompts.prompt_ids))
    t = config.train
    if resume is None:
        run_dir = make_run_dir(t.output_dir, t.run_name, config.algo.advantage.estimator)
        (run_dir / "config.yaml").write_text(config.to_yaml())
    else:
        run_dir = resume[0]
        for name in ("summary.json", STATUS):  # the run goes on: no longer finished, failed or interrupted
            (run_dir / name).unlink(missing_ok=True)
    console.print(
        f"run directory: [bold]{escape(str(run_dir))}[/]  prompts: {len(prompts)}  model: {escape(model_path)}",
        soft_wrap=True,
    )
    trainer = Trainer(config, pm, plan, prompts, tokenizer, model_path)
    trainer.memory_plan = mplan
    log: MetricsLog | None = None
    start = 0
    try:
        stop = StopRequests(console)
        with stop:
            trainer.setup()
            for where, what in trainer.placement.describe().items():
                console.print(f"  {escape(where)}: {escape(what)}")
            if resume is not None:
                start = trainer.load_checkpoint(resume[1])
                console.print(f"resumed from {escape(str(resume[1]))} after step {start}")
            log = MetricsLog(run_dir, start)
            trainer.history = [r for r in log.kept if "reward/mean" in r]
            trainer.eval_history = [r for r in log.kept if is_eval_row(r)]
            recoverable = callable(getattr(trainer.placement, "recover", None)) and \
                getattr(trainer.placement, "max_restarts", 0) > 0
            if recoverable and not checkpoint.complete(run_dir):
                trainer.save_checkpoint(run_dir, t.keep_checkpoints)  # a state to go back to after a fault
            pm.notify("rlhf_before_train", config=config, run_dir=run_dir)
            if held is not None:
                trainer.evaluator = make_evaluator(config, pm, tokenizer, trainer.engine, trainer.reward, held,
                                                   trainer.env_runner)
                if start == 0:
                    with TaskProgress(console if t.progress else None, "eval", "prompts") as bar:
                        run_eval(trainer, run_dir, log, console, bar)
            restarts, step = 0, start
            with StepProgress(t.steps, console, enabled=t.progress, start=start) as progress:
                while step < t.steps:
                    try:
                        metrics = trainer.step(step)
                        if restarts:
                            metrics["fault/restarts"] = float(restarts)
                        log.log(step, metrics)
                        pm.notify("rlhf_after_step", step=step, metrics=metrics)
                        progress.update(step + 1, metrics)
                        done = step = step + 1
                        if held is not None and eval_due(config, done):
                            run_eval(trainer, run_dir, log, console, lambda d, n: progress.phase(f"eval {d}/{n}"))
                            progress.phase("")
                        if stop.signum is not None:
                            trainer.save_checkpoint(run_dir, t.keep_checkpoints)
                            raise Interrupted(f"interrupted at step {done}; {resume_hint(run_dir)}",
                                              EXIT_CODES[stop.signum])
                        if t.save_every and done % t.save_every == 0 and done < t.steps:
                            trainer.save_checkpoint(run_dir, t.keep_checkpoints)
                    except RoleFailed as exc:
                        if not recoverable:
                            raise
                        restarts += 1
                        step = recover(trainer, run_dir, log, console, exc)
            if start < t.steps or not checkpoint.complete(run_dir):
                trainer.save_checkpoint(run_dir, t.keep_checkpoints)
        final = run_dir / "final"
        if t.save_final:
            trainer.save_final(final)
        summary = trainer.summary()
        summary["final_model"] = str(final) if t.save_final else None
        write_json(run_dir / "summary.json", summary)
        console.print(
            f"mean reward: first 10% of steps {summary['reward_first_10pct']:.3f} -> last 10% "
            f"{summary['reward_last_10pct']:.3f} ({summary['reward_gain']:+.3f}); "
            f"{summary['seconds_per_step']:.2f} s/step; policy saved to {summary['final_model']}",
            highlight=False, soft_wrap=True,
        )
        if "eval_first" in summary:
            first, last = summary["eval_first"], summary["eval_last"]
            changes = "  ".join(f"{k.removeprefix('eval/')} {first.get(k, float('nan')):.3f} -> {v:.3f}"
                                for k, v in last.items() if k.startswith("eval/"))
            console.print(f"held-out, step {first['step']} -> {last['step']}: {changes}", highlight=False,
                          soft_wrap=True)
        if "best" in summary:
            b = summary["best"]
            console.print(f"best {b['metric']} {b['value']:.3f} after {b['step']} steps, kept in {run_dir / 'best'}",
                          highlight=False, soft_wrap=True)
        pm.notify("rlhf_after_train", run_dir=run_dir, metrics=summary)
        return run_dir
    except BaseException as exc:
        failed_step = trainer.step_count if trainer.phase != "idle" else None
        pm.notify("rlhf_on_error", step=failed_step, error=exc)
        if log is not None:
            log.close()
            log = None
        steps_done = trainer.step_count
        if isinstance(exc, Interrupted):
            _write_status(run_dir, "interrupted", steps_done, str(exc))
            raise
        if not isinstance(exc, KeyboardInterrupt) and is_out_of_memory(exc):
            oom = explain(exc, mplan, trainer.history, plan.placement.same_process)
            _write_status(run_dir, "failed", steps_done, str(oom))  # the run directory is kept to say so
            if steps_done:
                _save_what_can_be_saved(trainer, run_dir, t.keep_checkpoints)
            raise OutOfMemory(f"{oom}; status in {run_dir / STATUS}", oom.role, oom.peak_gb) from exc
        if steps_done == 0 and resume is None:
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing of value was made
            raise
        _save_what_can_be_saved(trainer, run_dir, t.keep_checkpoints)
        interrupted = isinstance(exc, KeyboardInterrupt)
        _write_status(run_dir, "interrupted" if interrupted else "failed", steps_done,
                      "KeyboardInterrupt" if interrupted else f"{type(exc).__name__}: {exc}".splitlines()[0])
        if isinstance(exc, UsageError):
            raise type(exc)(f"{exc}; the run is kept in {run_dir} (last complete step {steps_done}); after the fix, "
                            f"{resume_hint(run_dir)}") from exc
        if isinstance(exc, KeyboardInterrupt):
            when = f"during step {steps_done + 1}" if trainer.phase != "idle" else f"after step {steps_done}"
            found = checkpoint.complete(run_dir)
            since = f" (from the checkpoint of step {found[-1][0]})" if found else ""
            code = EXIT_CODES.get(stop.signum, 130)  # a SIGTERM whose step never finished: 143
            raise Interrupted(f"interrupted {when}; {resume_hint(run_dir)}{since}", code) from None
        raise
    finally:
        if log is not None:
            log.close()
        trainer.shutdown()


def recover(trainer: Any, run_dir: Path, log: Any, console: Console, exc: BaseException) -> int:
    """After a role died: restart what died, go back to the latest checkpoint everywhere, and
    return the step to continue from."""
    roles = trainer.placement.recover()
    _, latest = checkpoint.complete(run_dir)[-1]
    trainer.reset_sync()
    start = trainer.load_checkpoint(latest)
    log.rewind(start)
    trainer.history = [r for r in log.kept if "reward/mean" in r]
    console.print(f"rlhf: {escape(str(exc))}; restarted {', '.join(roles) or 'nothing'} and went back to "
                  f"step {start}", highlight=False)
    return start


#: how a run that did not finish ended: {"status": "failed" | "interrupted", "steps_done", "message"}
STATUS = "status.json"


def _write_status(run_dir: Path, status: str, steps_done: int, message: str) -> None:
    from .state import write_json

    try:
        write_json(run_dir / STATUS, {"status": status, "steps_done": steps_done, "message": message})
    except OSError as exc:  # the original error matters more
        logger.warning("could not record the run's status: %s", exc)


def _save_what_can_be_saved(trainer: Any, run_dir: Path, keep: int) -> None:
    """A step that failed before changing any weights leaves an exact state: checkpoint it."""
    if trainer.phase != "rollout" or trainer.snapshot is None:
        return
    if any(step == trainer.snapshot["step"] for step, _ in checkpoint.complete(run_dir)):
        return
    try:
        trainer.save_checkpoint(run_dir, keep, snapshot=trainer.snapshot)
    except Exception as exc:  # the original error matters more
        logger.warning("could not checkpoint the failed step: %s", exc)
