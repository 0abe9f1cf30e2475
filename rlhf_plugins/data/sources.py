"""Where rows come from: JSONL / JSON / CSV / parquet / Arrow files or folders of them (the types
OpenRLHF's --prompt_data reads through ``datasets``), folders written by
``datasets``' ``save_to_disk``, the built-in datasets, and several of these at once
(``--data.path a.jsonl,b.parquet``: OpenRLHF's comma-separated --prompt_data), concatenated or mixed
with ``--data.probs`` (its --prompt_data_probs)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DataError, hub_download, innermost

logger = logging.getLogger("rlhf_plugins")

#: the ``datasets`` builder of each file type (an ``.arrow`` file: an Arrow stream, as ``datasets`` writes them)
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
#: the builders whose files are binary (not checked as UTF-8 text)
BINARY = {"parquet", "arrow"}
TYPES = ".jsonl, .json, .csv, .parquet or .arrow"
#: each builder's file type, as the error lines name it
KINDS = {"json": "JSON", "csv": "CSV", "parquet": "parquet", "arrow": "Arrow"}
#: the builder of a folder ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` wrote
SAVED = "saved"


def saved_dataset(path: Path) -> bool:
    """A folder ``datasets`` saved (its state.json, or dataset_dict.json for several splits)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def data_files(path: Path, key: str = "data.path") -> tuple[str, list[str]]:
    """The ``datasets`` builder and the files behind a dataset path (checked, not read); ``key``
    names the config key that gave the path."""
    if path.is_file():
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(f"dataset file '{path}' has an unsupported type; use {TYPES}")
        return builder, [str(path)]
    if saved_dataset(path):
        return SAVED, [str(path)]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in BUILDERS and p.is_file())
        if not files:
            raise DataError(f"dataset folder '{path}' holds no {TYPES} file")
        kinds = {BUILDERS[p.suffix.lower()] for p in files}
        if len(kinds) > 1:
            raise DataError(f"dataset folder '{path}' mixes file types ({', '.join(sorted(kinds))}); keep one kind")
        return kinds.pop(), [str(p) for p in files]
    hub = hub_download(path, "dataset")
    if hub:
        raise DataError(f"dataset '{path}' does not exist here; {hub} and set --{key} DIR")
    raise DataError(f"dataset '{path}' does not exist; set --{key} to a {TYPES} file or folder")


#: built-in datasets by name (``--data.path builtin:addition-test``): task and split
BUILTIN = {f"{task}{suffix}": (task, split) for task in ("addition", "calculator")
           for suffix, split in (("", "all"), ("-train", "train"), ("-test", "test"))}


def builtin_rows(path: str | Path) -> list[dict[str, Any]] | None:
    """The rows of ``builtin:NAME``, ``None`` for any other path (an unknown name is an error)."""
    text = str(path)
    if not text.startswith("builtin:"):
        return None
    name = text.removeprefix("builtin:")
    if name not in BUILTIN:
        raise DataError(f"unknown built-in dataset '{name}'; choose one of: "
                        f"{', '.join('builtin:' + n for n in BUILTIN)}")
    task, split = BUILTIN[name]
    if task == "calculator":
        from ..models.tool_model import calculator_rows

        return calculator_rows(split)
    from ..models.tiny_model import task_rows

    return task_rows(split)


def read_dataset(path: str | Path) -> list[dict[str, Any]]:
    """The rows of one dataset: a built-in one, a file, a folder of files or a saved dataset."""
    import datasets

    builtin = builtin_rows(path)
    if builtin is not None:
        return builtin
    builder, files = data_files(Path(path))
    if builder == SAVED:
        return _read_saved(Path(path))
    for f in files:
        if builder not in BINARY and not _utf8(f):
            raise DataError(f"dataset file '{f}' is not UTF-8 text; convert it (e.g. iconv -t UTF-8)")
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a file it cannot read: our one line says why
    try:
        return datasets.load_dataset(builder, data_files=files, split="train").to_list()
    except Exception as exc:
        if all(_blank(f) for f in files):
            return []
        where = next(filter(None, map(_bad_json_line, files)), "") if builder == "json" else ""
        raise DataError(where or f"dataset '{path}' cannot be read as {KINDS[builder]}: {innermost(exc)}; mend the "
                        "file or write it again") from exc


def _bad_json_line(file: str) -> str:
    """For a JSON-lines file that ``datasets`` could not read: its first malformed line, named."""
    import json

    if not file.endswith(".jsonl"):
        return ""
    with open(file, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                row = json.loads(line.rstrip("\r\n")) if line.strip() else {}
            except ValueError as exc:
                return (f"dataset file '{file}' line {number} is not valid JSON ({exc.msg}, column {exc.colno}); "
                        "each line must be one JSON object")
            if not isinstance(row, dict):
                return f"dataset file '{file}' line {number} is a JSON {type(row).__name__}, not an object"
    return ""


def _blank(path: str) -> bool:
    """A file with no rows: empty, blank text, or a CSV file of its header line alone."""
    p = Path(path)
    size, builder = p.stat().st_size, BUILDERS.get(p.suffix.lower())
    if size == 0 or builder in BINARY or size >= 4096:
        return size == 0
    lines = [line for line in p.read_bytes().splitlines() if line.strip()]
    return len(lines) <= (1 if builder == "csv" else 0)


def _utf8(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as fh:
            while fh.read(1 << 20):
                pass
        return True
    except UnicodeDecodeError:
        return False


def first_rows(rows: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` rows (all of them when ``limit`` is 0): OpenRLHF's ``--max_samples``."""
    if not limit or len(rows) <= limit:
        return rows
    logger.info("using the first %d of %d rows (--data.max_samples)", limit, len(rows))
    return rows[:limit]


def dataset_paths(path: str | Path) -> list[str]:
    """The datasets a path names: several when it is a comma-separated list (and not itself a file)."""
    text = str(path)
    if "," not in text or Path(text).expanduser().exists():
        return [text]
    return [part.strip() for part in text.split(",") if part.strip()]


def check_datasets(path: str | None, probs: list[float], section: str) -> None:
    """Each dataset ``--{section}.path`` names exists and is of a kind we read; ``probs`` weigh them."""
    paths = dataset_paths(path) if path else []
    for part in paths:
        if builtin_rows(part) is None:
            data_files(Path(part).expanduser(), f"{section}.path")
    if probs and not paths:
        raise ConfigError(f"{section}.probs weighs the datasets of {section}.path; name them there, comma-separated")
    if probs and (len(probs) != len(paths) or min(probs) < 0 or sum(probs) <= 0):
        raise ConfigError(f"{section}.probs {probs} must give each of the {len(paths)} datasets of {section}.path a "
                          "probability >= 0 (not all 0), in their order")


def read_rows(path: str | Path, probs: list[float] | tuple = (), seed: int = 0, limit: int = 0) -> list[dict[str, Any]]:
    """The rows of the dataset(s) ``path`` names, the first ``limit`` of each (0: all; OpenRLHF's
    --max_samples); several are concatenated, or with ``probs`` interleaved -- each row drawn from a
    dataset chosen with those probabilities (seeded) until every dataset has given all its rows, as
    OpenRLHF's blending does (``datasets.interleave_datasets``, ``all_exhausted``)."""
    paths = dataset_paths(path)
    tables = [first_rows(read_dataset(p), limit) for p in paths]
    if len(tables) == 1:
        return tables[0]
    for p, table in zip(paths, tables):
        if not table:
            raise DataError(f"dataset '{p}' is empty; each dataset of a list needs rows")
        if set(table[0]) != set(tables[0][0]):
            raise DataError(f"datasets '{paths[0]}' and '{p}' have different columns ({', '.join(tables[0][0])} | "
                            f"{', '.join(table[0])}); give every dataset of a list the same columns")
    if not probs:
        return [row for table in tables for row in table]
    return _interleave(paths, tables, [p / sum(probs) for p in probs], seed)


def _interleave(paths: list[str], tables: list[list[dict[str, Any]]], probs: list[float],
                seed: int) -> list[dict[str, Any]]:
    import datasets

    try:
        parts = [datasets.Dataset.from_list(t) for t in tables]
        mixed = datasets.interleave_datasets(parts, probabilities=probs, seed=seed, stopping_strategy="all_exhausted")
    except (ValueError, TypeError) as exc:  # columns of different types
        raise DataError(f"datasets {', '.join(paths)} cannot be mixed: {str(exc).splitlines()[0]}") from exc
    return mixed.to_list()


def _read_saved(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``save_to_disk`` folder: its dataset, or of several splits the train split."""
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as exc:  # a damaged or foreign folder: datasets' own reason, in one line
        raise DataError(f"dataset folder '{path}' cannot be read: {innermost(exc)}; save it again with "
                        "save_to_disk") from exc
    if isinstance(saved, datasets.DatasetDict):
        if "train" not in saved and len(saved) != 1:
            raise DataError(f"dataset folder '{path}' holds the splits {', '.join(saved)} and no 'train'; give one: "
                            f"{path / next(iter(saved))}")
        saved = saved["train"] if "train" in saved else next(iter(saved.values()))
    return saved.to_list()
