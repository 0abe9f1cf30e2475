"""``rlhf samples RUN_DIR``: what a run's policy wrote at one of its logged steps (``samples.jsonl``, from
``--train.log_samples_every``), as the table ``--train.print_samples`` prints during training -- for a run
that did not print, or ran on another machine; with ``--eval``, a held-out evaluation's records
(``eval_samples.jsonl``, from ``--eval.log_samples``), a row per prompt."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from ..errors import UsageError

#: how the rows of a step can be ordered (``--sort``): as generated, or by a field, highest first; held-out
#: records (``--eval``) as evaluated, or the prompts with the fewest correct samples first
ORDERS = ("generated", "reward", "advantage", "tokens", "failing")


def add_parser(sub: Any, plugin_args: Any) -> None:
    p = sub.add_parser("samples", allow_abbrev=False, help="show the samples a run logged at a step",
                       description="Print the samples a run logged at one step (samples.jsonl, written with "
                                   "--train.log_samples_every N): prompt, completion, each reward, the advantage.")
    p.add_argument("run", metavar="RUN_DIR", help="a run directory")
    p.add_argument("--step", type=int, help="the step (as metrics.jsonl counts, from 0); default: the last logged")
    p.add_argument("-n", type=int, default=8, help="how many samples to show (default: 8; 0: all)")
    p.add_argument("--sort", choices=ORDERS, default="generated",
                   help="order: as generated (prompt by prompt; default) or by reward, advantage or tokens, "
                        "highest first; with --eval: failing (the prompts with the fewest correct samples first)")
    p.add_argument("--eval", action="store_true",
                   help="a held-out evaluation's records instead (eval_samples.jsonl, --eval.log_samples true): a "
                        "row per prompt with its correct samples and greedy answer")
    p.add_argument("--json", action="store_true", help="the rows as JSON lines instead of a table")


def run(args: argparse.Namespace, rest: list[str], console: Console) -> int:
    from ..tables import print_eval_samples, print_samples
    from ..training.runlog import read_metrics

    if rest:
        raise UsageError(f"unrecognized arguments: {' '.join(rest)}")
    if args.n < 0:
        raise UsageError(f"-n must be 0 (all) or more; got {args.n}")
    if args.eval and args.sort not in ("generated", "failing"):
        raise UsageError(f"--sort {args.sort} orders training samples; held-out records (--eval) sort by failing")
    if args.sort == "failing" and not args.eval:
        raise UsageError("--sort failing orders held-out records: add --eval")
    if not Path(args.run).is_dir():
        raise UsageError(f"run directory '{args.run}' does not exist")
    name, what, flag = ("eval_samples.jsonl", "held-out records", "--eval.log_samples true") if args.eval else \
        ("samples.jsonl", "samples", "--train.log_samples_every N")
    rows = read_metrics(Path(args.run) / name)
    if not rows:
        raise UsageError(f"'{args.run}' holds no logged {what}: train with {flag} to log them")
    steps = sorted({r["step"] for r in rows})
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise UsageError(f"step {step} logged no {what} in '{args.run}'; logged steps: {_listed(steps)}")
    at_step = rows_at(rows, step)
    chosen = _ordered(at_step, args.sort)
    chosen = chosen[: args.n] if args.n else chosen
    title = f"step {step} of {args.run} ({len(chosen)} of {len(at_step)})"
    if args.json:
        console.print("\n".join(json.dumps(r) for r in chosen), highlight=False, soft_wrap=True, markup=False)
    elif args.eval:
        print_eval_samples(console, chosen, title)
    else:
        print_samples(console, chosen, title)
    return 0


def rows_at(rows: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    return [r for r in rows if r["step"] == step]


def _ordered(rows: list[dict[str, Any]], order: str) -> list[dict[str, Any]]:
    """``rows`` as generated, or by a field, highest first (a missing value last)."""
    if order == "generated":
        return rows
    if order == "failing":  # held-out records: the fewest correct samples first
        return sorted(rows, key=lambda r: sum(s["correct"] for s in r["samples"]))
    return sorted(rows, key=lambda r: (r.get(order) is not None, r.get(order) or 0.0), reverse=True)


def _listed(steps: list[int]) -> str:
    """The logged steps, the first and last few of a long list."""
    shown = [str(s) for s in steps] if len(steps) <= 8 else [*map(str, steps[:4]), "...", *map(str, steps[-3:])]
    return ", ".join(shown)
