"""What the user's terminal shows besides rich output: rlhf's own log lines, one per record, and
the known noise of the stack (deprecation warnings, vLLM's info lines) kept out unless ``-v``."""
from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.markup import escape

logger = logging.getLogger("rlhf_plugins")


class _LineHandler(logging.Handler):
    """``rlhf: warning: ...`` on one line, to whatever ``sys.stderr`` is now (a job log, a pipe,
    a test's capture); a terminal gets rich's colours."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = record.levelname.lower()
            text = f"rlhf: {level}: {record.getMessage()}"
            if sys.stderr.isatty():
                colour = {"warning": "yellow", "error": "red"}.get(level, "dim")
                Console(stderr=True, soft_wrap=True).print(f"[{colour}]rlhf: {level}:[/] {escape(record.getMessage())}",
                                                           highlight=False)
            else:
                sys.stderr.write(text + "\n")
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


#: libraries whose deprecation and future warnings are theirs to fix, not the user's
NOISY = r"(vllm|transformers|torch|deepspeed|ray|trl|peft|accelerate|datasets|triton)(\.|$)"


def quiet_third_party() -> None:
    """Keep the known noise of the stack out of the user's terminal (``-v`` shows it): deprecation
    and future warnings raised inside the libraries, vLLM's info and warning lines, torch's C++
    warnings, datasets' per-pass bars (TRL's tokenizing of a stage's data: our bar is the run's).
    Environment variables carry it to engine processes and Ray workers started from here."""
    import os
    import warnings

    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=NOISY)
    # TRL's check of the installed vLLM against the range its own vLLM client was tested with: TRL's client is
    # never used here (the engines are this project's), so a newer vLLM says nothing about a run
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.ERROR)  # some of vLLM warns before it configures its logging
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when datasets is imported
    if "datasets" in sys.modules:  # imported already (a caller's process): switched off in place
        sys.modules["datasets"].disable_progress_bars()


def setup_logging(verbose: bool) -> None:
    """rlhf's own log lines on stderr, one per record (``-v``: debug too)."""
    if not logger.handlers:
        logger.addHandler(_LineHandler())
        logger.propagate = False
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
