"""Prompt datasets: JSONL / JSON / parquet files or folders, read with ``datasets``.

Each row gives a prompt (a string, or a list of chat messages) and optionally a
label; every column reaches the reward functions as a keyword argument (the
label column under the name ``label``).
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DataError

logger = logging.getLogger("rlhf_plugins")

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class PromptSet:
    prompts: list[Any]
    prompt_ids: list[list[int]]
    #: every other column, per prompt; the configured label column is called ``label``
    columns: dict[str, list[Any]] = field(default_factory=dict)
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.prompts)

    def head(self, n: int) -> PromptSet:
        """The first ``n`` prompts (all of them when ``n`` is 0)."""
        if not n or n >= len(self):
            return self
        columns = {k: v[:n] for k, v in self.columns.items()}
        return PromptSet(self.prompts[:n], self.prompt_ids[:n], columns, self.dropped)


def data_files(path: Path, key: str = "data.path") -> tuple[str, list[str]]:
    """The ``datasets`` builder and the files behind a dataset path (checked, not read); ``key``
    names the config key that gave the path."""
    if path.is_file():
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(f"dataset file '{path}' has an unsupported type; use .jsonl, .json or .parquet")
        return builder, [str(path)]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in BUILDERS and p.is_file())
        if not files:
            raise DataError(f"dataset folder '{path}' holds no .jsonl, .json or .parquet file")
        kinds = {BUILDERS[p.suffix.lower()] for p in files}
        if len(kinds) > 1:
            raise DataError(f"dataset folder '{path}' mixes JSON and parquet files; keep one kind")
        return kinds.pop(), [str(p) for p in files]
    raise DataError(f"dataset '{path}' does not exist; set --{key} to a .jsonl/.json/.parquet file or folder")


#: built-in datasets by name (``--data.path builtin:addition-test``): task and split
BUILTIN = {f"{task}{suffix}": (task, split) for task in ("addition", "calculator")
           for suffix, split in (("", "all"), ("-train", "train"), ("-test", "test"))}


#: what ``rlhf train`` trains on without --data.path: the built-in task's training split
DEFAULT_DATA = "builtin:addition-train"
SPLIT = "split"


def eval_source(config: Any, rows_given: bool = False) -> str | None:
    """Where held-out prompts come from: ``--eval.path``; else ``"split"`` (a fraction of the
    training rows); else the test split of a built-in ``NAME-train`` dataset; else ``None``.
    ``rows_given``: the training rows come from Python (a dataset object), not from data.path."""
    e = config.eval
    if not e.enabled:
        return None
    if e.path:
        return e.path
    if e.split > 0:
        return SPLIT
    if rows_given:
        return None
    data = config.data.path or DEFAULT_DATA
    if data.startswith("builtin:") and data.endswith("-train"):
        test = data.removesuffix("-train") + "-test"
        return test if test.removeprefix("builtin:") in BUILTIN else None
    return None


def split_rows(rows: list[dict[str, Any]], fraction: float,
               seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, held-out rows): a seeded ``fraction`` of the rows (at least one) held out."""
    if len(rows) < 2:
        raise DataError(f"eval.split needs at least 2 training rows to hold some out; the data has {len(rows)}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n = min(len(rows) - 1, max(1, round(len(rows) * fraction)))
    held = set(order[:n])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


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


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    import datasets

    builtin = builtin_rows(path)
    if builtin is not None:
        return builtin
    builder, files = data_files(Path(path))
    for f in files:
        if not f.endswith(".parquet") and not _utf8(f):
            raise DataError(f"dataset file '{f}' is not UTF-8 text; convert it (e.g. iconv -t UTF-8)")
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a file it cannot read: our one line says why
    try:
        return datasets.load_dataset(builder, data_files=files, split="train").to_list()
    except Exception as exc:
        if all(_blank(f) for f in files):
            return []
        where = next(filter(None, map(_bad_json_line, files)), "") if builder == "json" else ""
        raise DataError(where or f"dataset '{path}' cannot be read: {type(exc).__name__}: {exc}".splitlines()[0]) \
            from exc


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
    p = Path(path)
    return p.stat().st_size == 0 or (p.suffix != ".parquet" and p.stat().st_size < 4096 and not p.read_bytes().strip())


def _utf8(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as fh:
            while fh.read(1 << 20):
                pass
        return True
    except UnicodeDecodeError:
        return False


def check_input_template(template: str | None, key: str = "data.input_template") -> None:
    """OpenRLHF's ``--input_template``: a format string with one ``{}`` where the prompt goes."""
    if template is None:
        return
    try:
        filled = template.format("\0")
    except (IndexError, KeyError, ValueError):
        filled = ""
    if filled.count("\0") != 1:
        raise ConfigError(f"{key} must hold one {{}} where the prompt goes (a literal brace doubled: {{{{ }}}}), "
                          f"e.g. 'User: {{}}\\nAssistant: '; got {template!r}")


def fill_template(template: str | None, prompt: Any) -> Any:
    """A plain-text prompt put in its place in ``template`` (chat messages and no template: as they are)."""
    return template.format(prompt) if template and isinstance(prompt, str) else prompt


def first_rows(rows: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` rows (all of them when ``limit`` is 0): OpenRLHF's ``--max_samples``."""
    if not limit or len(rows) <= limit:
        return rows
    logger.info("using the first %d of %d rows (--data.max_samples)", limit, len(rows))
    return rows[:limit]


def load_prompts(cfg: Any, tokenizer: Any, rows: list[dict[str, Any]] | None = None, limit: int = 0) -> PromptSet:
    """Read (or take ``rows``), keep the first ``limit`` (0: all), template and tokenize every prompt;
    check keys and emptiness first."""
    path = "the given rows" if rows is not None else (cfg.path or DEFAULT_DATA)
    if rows is None:
        rows = read_rows(path)
    rows = first_rows(rows, limit)
    if not rows:
        raise DataError(f"dataset '{path}' is empty; it needs at least one row with a '{cfg.prompt_key}' field")
    if cfg.prompt_key not in rows[0]:
        raise DataError(
            f"dataset '{path}' has no '{cfg.prompt_key}' column (columns: {', '.join(rows[0])}); "
            "set --data.prompt_key"
        )
    templated = cfg.template_strings or any(not isinstance(r.get(cfg.prompt_key), str) for r in rows)
    if cfg.apply_chat_template and templated and not getattr(tokenizer, "chat_template", None):
        raise DataError("the model's tokenizer has no chat template; set --data.apply_chat_template false")
    prompts, ids, dropped = [], [], 0
    empty = too_long = filled = 0
    columns: dict[str, list[Any]] = {}
    for number, row in enumerate(rows, 1):
        prompt = row[cfg.prompt_key]
        if prompt is None or prompt == "" or prompt == []:
            dropped, empty = dropped + 1, empty + 1
            continue
        check_prompt(prompt, number, path, cfg.prompt_key)
        chat = cfg.apply_chat_template and (cfg.template_strings or not isinstance(prompt, str))
        if cfg.input_template and not chat and isinstance(prompt, str):
            prompt, filled = cfg.input_template.format(prompt), filled + 1
        tokens = encode_prompt(prompt, tokenizer, chat)
        if len(tokens) > cfg.max_prompt_tokens:
            dropped, too_long = dropped + 1, too_long + 1
            continue
        prompts.append(prompt)
        ids.append(tokens)
        for key, value in row.items():
            if key == cfg.prompt_key:
                continue
            columns.setdefault("label" if key == cfg.label_key else key, []).append(value)
    if not prompts:
        raise DataError(
            f"dataset '{path}' has no usable prompt: all {len(rows)} are empty or longer than "
            f"--data.max_prompt_tokens {cfg.max_prompt_tokens}"
        )
    if cfg.input_template and not filled:
        raise DataError(f"data.input_template puts plain-text prompts in place, but every prompt of '{path}' is chat "
                        "messages, which the chat template renders; drop --data.input_template")
    if dropped:
        why = [f"{empty} empty"] * bool(empty) + [f"{too_long} longer than --data.max_prompt_tokens "
                                                 f"{cfg.max_prompt_tokens}"] * bool(too_long)
        logger.warning("dropped %d of %d prompts (%s)", dropped, len(rows), ", ".join(why))
    return PromptSet(prompts, ids, columns, dropped)


def check_prompt(prompt: Any, number: int, path: Any, key: str) -> None:
    """A prompt is a string or a list of chat messages ``{"role": ..., "content": str}``."""
    where = f"dataset '{path}' row {number}: '{key}'"
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list):
        raise DataError(f"{where} is {type(prompt).__name__} {str(prompt)[:40]!r}; a prompt is a string or a list of "
                        "chat messages {\"role\": ..., \"content\": ...}")
    for message in prompt:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DataError(f"{where} holds a chat message that is not {{\"role\": str, \"content\": str}}: "
                            f"{str(message)[:60]!r}")


def encode_prompt(prompt: Any, tokenizer: Any, chat: bool) -> list[int]:
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if not isinstance(prompt, str):
        raise DataError("a chat-message prompt needs --data.apply_chat_template true")
    return tokenizer(prompt)["input_ids"]
