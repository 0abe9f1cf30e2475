"""What reward sources return, made into checked lists: a list, a tensor or an array of numbers (None
where a source abstains), or OpenRLHF's ``{"rewards": ..., "scores": ...}``; and a source's call
bounded in time; and, for a reward that failed, the parameters it names that no dataset column fills."""
from __future__ import annotations

import inspect
import math
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..errors import RewardError


def call_with_timeout(fn: Callable[..., Any], kwargs: dict[str, Any], timeout: float, message: str) -> Any:
    """``fn(**kwargs)`` in a daemon thread, waited for at most ``timeout`` seconds (a call that never
    returns is left behind and cannot keep the process alive)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="rlhf-reward", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RewardError(message)
    if "error" in box:
        raise box["error"]
    return box["value"]


def rewards_and_scores(out: Any, where: str, n: int) -> tuple[list[float | None], list[float | None] | None]:
    """A source's rewards (None where it abstained), checked, and its own ``scores`` where it returned
    OpenRLHF's ``{"rewards": ..., "scores": ...}`` (rewards train, scores are what dynamic filtering
    compares)."""
    given = None
    if isinstance(out, dict) and "rewards" in out:
        if out.get("scores") is not None:
            given = _checked(_as_list(out["scores"], f"{where} ('scores')"), f"{where} ('scores')", n)
        out = out["rewards"]
    return _checked(_as_list(out, where), where, n), given


def _checked(values: list[Any], where: str, n: int) -> list[float | None]:
    if len(values) != n:
        raise RewardError(f"{where} returned {len(values)} scores for {n} completions")
    for i, v in enumerate(values):
        if v is None:
            continue
        if not isinstance(v, (int, float)):  # a bool too: a check's outcome, 1 or 0 (TRL's float tensor of it)
            raise RewardError(f"{where} returned {type(v).__name__} {v!r} for sample {i}; expected a number")
        if not math.isfinite(v) or abs(v) > 1e12:
            raise RewardError(f"{where} returned {v} for sample {i}; scores must be finite numbers within +-1e12")
    return [None if v is None else float(v) for v in values]


def _as_list(out: Any, where: str) -> list[Any]:
    # a process whose rewards never imported torch has no tensors (the reward role does not import it)
    torch = sys.modules.get("torch")
    is_tensor = torch.is_tensor if torch is not None else (lambda _: False)
    if is_tensor(out):
        return out.detach().float().reshape(-1).tolist()
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):
        return list(out.tolist())
    if isinstance(out, (list, tuple)):  # 0-d tensors and numpy scalars (np.float32(1.0)) as Python numbers
        return [v.item() if is_tensor(v) or getattr(v, "shape", None) == () else v for v in out]
    raise RewardError(f"{where} returned {type(out).__name__}; expected a list of floats")


#: what every reward function is offered besides the dataset's columns (TRL's keywords and ours)
OFFERED = {"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra", "queries",
           "prompt_texts", "prompt_ids", "finish_reasons"}


def absent_columns(fn: Callable[..., Any], columns: dict[str, Any]) -> str:
    """For a reward function that raised: the named parameters it takes that neither a dataset column
    nor a keyword every reward gets fills (its ``answer`` where the dataset's column is ``label``),
    as a clause for its error line; empty where there are none."""
    from ..rewards.callables import TRLReward

    try:
        params = inspect.signature(fn.fn if isinstance(fn, TRLReward) else fn).parameters.values()
    except (TypeError, ValueError):
        return ""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    absent = [p.name for p in params if p.kind in named and p.name not in columns and p.name not in OFFERED]
    if not absent:
        return ""
    return (f" -- it takes {', '.join(repr(a) for a in absent)}, which no column of the dataset fills (its columns "
            f"besides the prompt: {', '.join(sorted(columns)) or 'none'})")
