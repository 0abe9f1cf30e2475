"""How a run stops: SIGINT / SIGTERM finish the current step, write a checkpoint and stop with
130 / 143; a second SIGINT stops at once, and so does a step still running :data:`STOP_GRACE`
seconds after the first signal. A run that did not finish says how it ended in ``status.json``.
A run whose placement restarts roles goes back to its latest checkpoint after a role died (:func:`recover`).
"""
from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from . import checkpoint

logger = logging.getLogger("rlhf_plugins")

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
#: seconds a step may still take after SIGINT / SIGTERM before the run stops at once
STOP_GRACE = 10.0
#: how a run that did not finish ended: {"status": "failed" | "interrupted", "steps_done", "message"}
STATUS = "status.json"


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

    @property
    def exit_code(self) -> int:
        """130 for SIGINT (or no signal: a Ctrl-C that arrived as KeyboardInterrupt), 143 for SIGTERM."""
        return EXIT_CODES.get(self.signum, 130)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        self.console.print(f"rlhf: {signal.Signals(signum).name} received: finishing this step, then saving a "
                           f"checkpoint (Ctrl-C again stops at once; so does a step still running in "
                           f"{STOP_GRACE:g} s)", highlight=False)
        # a real signal to the main thread: it wakes a blocking wait (a lock, a sleep, a socket), which
        # ``_thread.interrupt_main`` (a flag checked between bytecodes) would not
        self._deadline = threading.Timer(STOP_GRACE, signal.pthread_kill,
                                         args=(threading.main_thread().ident, signal.SIGINT))
        self._deadline.daemon = True
        self._deadline.start()


def resume_hint(run_dir: Path) -> str:
    return f"resume with: rlhf train --resume {run_dir}"


def write_status(run_dir: Path, status: str, steps_done: int, message: str) -> None:
    from .state import write_json

    try:
        write_json(run_dir / STATUS, {"status": status, "steps_done": steps_done, "message": message})
    except OSError as exc:  # the original error matters more
        logger.warning("could not record the run's status: %s", exc)


def save_failed_step(trainer: Any, run_dir: Path, keep: int) -> None:
    """A step that failed before changing any weights leaves an exact state: checkpoint it."""
    from .checkpoint import complete

    if trainer.phase != "rollout" or trainer.snapshot is None:
        return
    if any(step == trainer.snapshot["step"] for step, _ in complete(run_dir)):
        return
    try:
        trainer.save_checkpoint(run_dir, keep, snapshot=trainer.snapshot)
    except Exception as exc:  # the original error matters more
        logger.warning("could not checkpoint the failed step: %s", exc)


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
