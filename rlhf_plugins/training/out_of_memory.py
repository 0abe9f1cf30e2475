"""Out of memory as an error a user can act on.

Whatever ran out -- a torch allocation (CPU or GPU), a Ray actor killed by Ray's memory monitor, a
vLLM KV cache that does not fit -- the run stops with one line naming the role, its measured peak,
its analytic need from the memory plan, and the flags that reduce the largest items of that need;
``status.json`` records it. Ray's 60-line memory report and tracebacks are not shown (``-v`` shows
the traceback).
"""
from __future__ import annotations

import re
import resource
from typing import Any

from ..errors import UsageError, causes
from ..models.memory import GIB

#: what the libraries say when memory ran out (torch on CPU and GPU, Ray's memory monitor, vLLM)
SIGNS = ("can't allocate memory", "out of memory", "outofmemoryerror", "running low on memory",
         "killed due to memory", "oom", "kv cache", "cannot allocate memory")
_RAY_USED = re.compile(r"memory used=([0-9.]+)\s*GB", re.IGNORECASE)


class OutOfMemory(UsageError):
    """A role ran out of memory; the message names it, its peak and need, and what to change."""

    exit_code = 1

    def __init__(self, message: str, role: str | None = None, peak_gb: float | None = None) -> None:
        super().__init__(message)
        self.role, self.peak_gb = role, peak_gb


def is_out_of_memory(exc: BaseException) -> bool:
    for e in causes(exc):
        if isinstance(e, (MemoryError, OutOfMemory)) or type(e).__name__ == "OutOfMemoryError":
            return True
        text = f"{type(e).__name__}: {e}".lower()
        if any(re.search(rf"\b{re.escape(sign)}\b", text) for sign in SIGNS if sign != "kv cache"):
            return True
        if "kv cache" in text and "memory" in text:
            return True
    return False


def role_of(exc: BaseException) -> str | None:
    """The role whose code raised: named by the error (Ray), else the innermost role object on the stack."""
    from .roles import Role

    for e in causes(exc):
        role = getattr(e, "role", None)
        if isinstance(role, str):
            return role
    role = None
    tb = exc.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, Role):
            role = obj.role
        tb = tb.tb_next
    return role


def measured_peak(exc: BaseException, role: str | None, history: list[dict[str, float]], local: bool) -> float | None:
    """GB: Ray's report of the killed process, this process's peak (roles here), or the last logged one."""
    for e in causes(exc):
        found = _RAY_USED.search(str(e))
        if found:
            return float(found.group(1))
        if isinstance(e, OutOfMemory) and e.peak_gb is not None:
            return e.peak_gb
    if local:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    for row in reversed(history):
        if role and f"memory/{role}_rss_gb" in row:
            return float(row[f"memory/{role}_rss_gb"])
    return None


def explain(exc: BaseException, plan: Any, history: list[dict[str, float]], local: bool) -> OutOfMemory:
    """The one-line error for ``exc`` (known to be out of memory), from the run's memory plan."""
    from .remedies import REMEDIES

    role = role_of(exc)
    peak = measured_peak(exc, role, history, local)
    need = plan.roles.get(role) if plan is not None and role else None
    parts = [f"role '{role}' ran out of memory" if role else "the run ran out of memory"]
    facts = []
    if peak is not None:
        facts.append(f"its process peaked at {peak:.2f} GB")
    if need is not None and need.known:
        facts.append(f"its analytic need is {need.total / GIB:.2f} GB per rank")
    if plan is not None and plan.node_bytes:
        facts.append(f"the plan needs {plan.total / GIB:.2f} GB of the node's {plan.node_bytes / GIB:.2f} GB")
    if facts:
        parts.append(f" ({'; '.join(facts)})")
    items = sorted(need.parts.items(), key=lambda kv: -kv[1])[:2] if need is not None else []
    remedies = plan.remedies if plan is not None else REMEDIES
    fixes = "; ".join(f"{k}: {remedies.get(k, 'reduce it')}" for k, _ in items) or (
        "shard the learner (--deepspeed.zero_stage 3 over more ranks), a smaller micro batch "
        "(--learner.micro_batch_size), --vllm.kv_cache_mb")
    parts.append(f"; reduce it -- {fixes}")
    return OutOfMemory("".join(parts), role, peak)
