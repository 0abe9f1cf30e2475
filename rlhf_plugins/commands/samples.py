"""``rlhf samples RUN_DIR``: what a run's policy wrote at one of its logged steps (``samples.jsonl``, from
``--train.log_samples_every``), as the table ``--train.print_samples`` prints during training -- for a run
that did not print, or ran on another machine."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from ..errors import UsageError

#: how the rows of a step can be ordered (``--sort``): as generated, or by a field, highest first
ORDERS = ("generated", "reward", "advantage", "tokens")


def add_parser(sub: Any, plugin_args: Any) -> None:
    p = sub.add_parser("samples", allow_abbrev=False, help="show the samples a run logged at a step",
                       description="Print the samples a run logged at one step (samples.jsonl, written with "
                                   "--train.log_samples_every N): prompt, completion, each reward, the advantage.")
    p.add_argument("run", metavar="RUN_DIR", help="a run directory")
    p.add_argument("--step", type=int, help="the step (as metrics.jsonl counts, from 0); default: the last logged")
    p.add_argument("-n", type=int, default=8, help="how many samples to show (default: 8; 0: all)")
    p.add_argument("--sort", choices=ORDERS, default="generated",
                   help="order: as generated (prompt by prompt; default) or by reward, advantage or tokens, "
                        "highest first")
    p.add_argument("--json", action="store_true", help="the rows as JSON lines instead of a table")


def run(args: argparse.Namespace, rest: list[str], console: Console) -> int:
    from ..tables import print_samples
    from ..training.runlog import read_metrics

    if rest:
        raise UsageError(f"unrecognized arguments: {' '.join(rest)}")
    if args.n < 0:
        raise UsageError(f"-n must be 0 (all) or more; got {args.n}")
    path = Path(args.run) / "samples.jsonl"
    if not Path(args.run).is_dir():
        raise UsageError(f"run directory '{args.run}' does not exist")
    rows = read_metrics(path)
    if not rows:
        raise UsageError(f"'{args.run}' holds no logged samples: train with --train.log_samples_every N to log "
                         "every N-th step's samples")
    steps = sorted({r["step"] for r in rows})
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise UsageError(f"step {step} logged no samples in '{args.run}'; logged steps: {_listed(steps)}")
    chosen = _ordered(rows_at(rows, step), args.sort)
    chosen = chosen[: args.n] if args.n else chosen
    if args.json:
        console.print("\n".join(json.dumps(r) for r in chosen), highlight=False, soft_wrap=True, markup=False)
    else:
        print_samples(console, chosen, f"step {step} of {args.run} ({len(chosen)} of {len(rows_at(rows, step))})")
    return 0


def rows_at(rows: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    return [r for r in rows if r["step"] == step]


def _ordered(rows: list[dict[str, Any]], order: str) -> list[dict[str, Any]]:
    """``rows`` as generated, or by a field, highest first (a missing value last)."""
    if order == "generated":
        return rows
    return sorted(rows, key=lambda r: (r.get(order) is not None, r.get(order) or 0.0), reverse=True)


def _listed(steps: list[int]) -> str:
    """The logged steps, the first and last few of a long list."""
    shown = [str(s) for s in steps] if len(steps) <= 8 else [*map(str, steps[:4]), "...", *map(str, steps[-3:])]
    return ", ".join(shown)
