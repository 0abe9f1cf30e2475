"""Errors a user can fix. The CLI prints their one-line message and exits with 2."""
from __future__ import annotations


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what caused it, outermost first (a Ray error's ``cause``, ``__cause__``, ``__context__``)."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return seen


def summary(exc: BaseException) -> str:
    """An error in one line: ``Type: first line of its message`` (the type alone when it has none)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def innermost(exc: BaseException) -> str:
    """What first went wrong behind ``exc``: its innermost cause's :func:`summary`."""
    return summary(causes(exc)[-1])


def hub_download(path: object, what: str = "model") -> str | None:
    """How to fetch ``path`` when it is not here and reads as a Hugging Face Hub id (``owner/name``, as OpenRLHF's
    and TRL's commands name models and datasets): runs read local folders only. None for anything else."""
    from pathlib import Path

    text = str(path)
    parts = text.split("/")
    data_file = text.lower().endswith((".jsonl", ".json", ".csv", ".parquet", ".arrow"))
    if len(parts) != 2 or not all(parts) or text.startswith((".", "~")) or data_file or Path(text).exists():
        return None
    kind = " --repo-type dataset" if what == "dataset" else ""
    return f"if it names a Hugging Face Hub {what}, download it (hf download{kind} {text} --local-dir DIR)"


class UsageError(Exception):
    """A mistake in what the user asked for (config, plugin, data, reward)."""

    exit_code = 2


class ConfigError(UsageError):
    """An invalid config value or an impossible combination of components."""


class PluginError(UsageError):
    """A plugin that cannot be found, imported or registered."""


class RewardError(UsageError):
    """A reward function that raised or returned something unusable."""


class DataError(UsageError):
    """A prompt dataset that is missing, empty or lacks the configured keys."""


class Interrupted(Exception):
    """The run stopped on a signal after saving a checkpoint; the message says how to resume."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class RoleFailed(UsageError):
    """A role's process died (a killed actor, a lost node). A placement that can restart roles
    (``recover()``) lets the loop continue from the latest checkpoint; when it cannot, the run
    stops with this one line (exit status 1: not a user mistake)."""

    exit_code = 1


class RoleCallTimeout(UsageError):
    """A call to a role did not return in time; the message names the role, rank and method."""


class EnvironmentFailed(UsageError):
    """A multi-turn environment that raised or answered with the wrong types (reset, step,
    get_reward); the message names the environment and the dataset row."""
