"""Each role's measured memory, every step: the peak resident set of its process (and the peak GPU
memory where it has a GPU), read in the role's own process through ``RoleHandle.run`` -- one small
call per role, so a Ray role reports its actor's memory, not the driver's.

Logged as ``memory/<role>_rss_gb`` (the largest over the role's ranks) and ``memory/<role>_gpu_gb``,
with ``memory/peak_gb`` the largest of all; the summary sets each peak beside the role's analytic
minimum from the memory plan.
"""
from __future__ import annotations

import os
import resource
import sys
from typing import Any

from ..models.memory import GIB


def process_memory(ctx: Any = None) -> dict[str, float]:
    """This process's peak resident set (and peak GPU memory), in GB; runs inside the role's process."""
    out = {"rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, "pid": float(os.getpid())}
    torch = sys.modules.get("torch")  # a rule-reward role never imports it
    if torch is not None and torch.cuda.is_available():
        out["gpu_gb"] = torch.cuda.max_memory_allocated() / GIB
    return out


def role_memory(roles: dict[str, Any]) -> dict[str, float]:
    """``memory/<role>_rss_gb`` (and ``_gpu_gb``) for every role handle in ``roles``; roles sharing a
    process report that process's peak."""
    metrics: dict[str, float] = {}
    for name, handle in roles.items():
        run = getattr(handle, "run", None)
        if handle is None or not callable(run):
            continue
        ranks = run(process_memory)
        for key in ("rss_gb", "gpu_gb"):
            values = [r[key] for r in ranks if key in r]
            if values:
                metrics[f"memory/{name}_{key}"] = max(values)
    peaks = [v for k, v in metrics.items() if k.endswith("_rss_gb")]
    if peaks:
        metrics["memory/peak_gb"] = max(peaks)
    return metrics


def largest(metrics: dict[str, float]) -> str:
    """``7.9G actor`` (the largest role peak of a metrics row), or ``0.7G`` when every role shares
    one process; for the progress line."""
    peaks = {k.removeprefix("memory/").removesuffix("_rss_gb"): v for k, v in metrics.items()
             if k.startswith("memory/") and k.endswith("_rss_gb")}
    if not peaks:
        return "-"
    role = max(peaks, key=peaks.get)
    return f"{peaks[role]:.1f}G" if len(set(peaks.values())) == 1 else f"{peaks[role]:.1f}G {role}"


def summary(history: list[dict[str, float]], plan: Any) -> dict[str, dict[str, float]]:
    """Per process of the memory plan: the measured peak over the run beside its analytic minimum
    and its imports, and their ratio ``(peak - imports) / analytic``."""
    peak: dict[str, float] = {}
    for row in history:
        for key, value in row.items():
            if key.startswith("memory/") and key.endswith("_rss_gb"):
                role = key.removeprefix("memory/").removesuffix("_rss_gb")
                peak[role] = max(peak.get(role, 0.0), value)
    if plan is None:
        return {role: {"peak_rss_gb": v} for role, v in peak.items()}
    out: dict[str, dict[str, float]] = {}
    for process in plan.processes:
        measured = [peak[r] for r in process.roles if r in peak]
        if not measured:
            continue
        entry = {"ranks": float(process.count), "peak_rss_gb": max(measured),
                 "analytic_gb": process.analytic / GIB, "imports_gb": process.imports / GIB}
        if process.analytic:
            entry["ratio"] = (entry["peak_rss_gb"] - entry["imports_gb"]) / entry["analytic_gb"]
        out["+".join(process.roles)] = entry
    return out
