"""A step's samples (the rows of ``samples.jsonl``, :mod:`rlhf_plugins.training.samples`) shown: as a table on
the terminal (``train.print_samples``, ``rlhf samples``) and as the columns and data of a tracker's table (W&B,
MLflow); a held-out evaluation's records (``eval_samples.jsonl``) as a table too, on the terminal and in a
tracker."""
from __future__ import annotations

from typing import Any

#: a dataset column's values go into a sample's row when they are of these types (a label, an answer; not
#: images or nested data)
PLAIN = (str, int, float, bool, type(None))


def table_of(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Rows of one step as a tracker's table (columns, data): prompt and completion as text, each reward, the
    combined reward, the advantage, the finish reason, and TRL's ``log_extra`` columns."""
    names, extra = list(rows[0]["rewards"]), list(rows[0].get("extra", {}))
    columns = ["prompt", "completion", *names, "reward", "advantage", "finish_reason", *extra]
    data = [[as_text(r["prompt"]), as_text(r["completion"]), *(r["rewards"][n] for n in names), r["reward"],
             r["advantage"], r["finish_reason"], *(r["extra"][k] for k in extra)] for r in rows]
    return columns, data


def eval_table_of(records: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """One evaluation's records (``eval_samples.jsonl``) as a tracker's table: a row per prompt with its plain
    columns, how many of its samples were correct, one wrong completion, and the greedy one and its verdict."""
    columns = ["prompt", "columns", "correct", "samples", "a wrong sample", "greedy", "greedy correct"]
    data = [[as_text(r["prompt"]), ", ".join(f"{k}={v}" for k, v in r["columns"].items()),
             sum(s["correct"] for s in r["samples"]), len(r["samples"]),
             next((s["completion"] for s in r["samples"] if not s["correct"]), ""), r["greedy"]["completion"],
             bool(r["greedy"]["correct"])] for r in records]
    return columns, data


def print_samples(console: Any, rows: list[dict[str, Any]], step: str) -> None:
    """Rows of one step (``step``, as the progress shows it) as a table: prompt, completion, each reward, the
    combined reward, the advantage, and the columns of TRL's ``log_extra``."""
    from rich.table import Table

    names, extra = list(rows[0]["rewards"]), list(rows[0].get("extra", {}))
    table = Table(title=f"samples of {step}", show_lines=True)
    numbers = (*names, "reward", "advantage")
    for header in ("prompt", "completion", *numbers, *extra):
        table.add_column(header, overflow="fold", justify="right" if header in numbers else "left")
    for row in rows:
        scores = [row["rewards"][n] for n in names] + [row["reward"], row["advantage"]]
        shown = ("-" if s is None else f"{s:.3f}" for s in scores)
        table.add_row(_text(row["prompt"]), _text(row["completion"]), *shown, *(_text(row["extra"][k]) for k in extra))
    console.print(table)


def print_eval_samples(console: Any, records: list[dict[str, Any]], title: str) -> None:
    """Held-out records of one evaluation as a table: a row per prompt with its plain columns (the label), how
    many of its samples were correct, one wrong completion, and the greedy completion and whether it was."""
    from rich.table import Table

    table = Table(title=f"held-out samples of {title}", show_lines=True)
    for header in ("prompt", "columns", "correct", "a wrong sample", "greedy"):
        table.add_column(header, overflow="fold", justify="right" if header == "correct" else "left")
    for r in records:
        wrong = next((s["completion"] for s in r["samples"] if not s["correct"]), "")
        greedy = f"{r['greedy']['completion']} ({'right' if r['greedy']['correct'] else 'wrong'})"
        table.add_row(_text(r["prompt"]), _text(", ".join(f"{k}={v}" for k, v in r["columns"].items())),
                      f"{sum(s['correct'] for s in r['samples'])}/{len(r['samples'])}", _text(wrong), _text(greedy))
    console.print(table)


def as_text(value: Any) -> str:
    """A prompt or completion as text: a conversation's messages one per line."""
    if isinstance(value, list):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" if isinstance(m, dict) else str(m)
                         for m in value)
    return str(value)


def _text(value: Any) -> Any:
    """:func:`as_text` for a table cell, never read as markup."""
    from rich.text import Text

    return Text(as_text(value))
