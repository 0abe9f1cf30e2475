"""Prompt datasets: JSONL / JSON / parquet files or folders, read with ``datasets``.

Each row gives a prompt (a string, or a list of chat messages) and optionally a
label; every column reaches the reward functions as a keyword argument (the
label column under the name ``label``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import DataError

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


def data_files(path: Path) -> tuple[str, list[str]]:
    """The ``datasets`` builder and the files behind a dataset path (checked, not read)."""
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
    raise DataError(f"dataset '{path}' does not exist; set --data.path to a .jsonl/.json/.parquet file or folder")


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    import datasets

    builder, files = data_files(Path(path))
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        ds = datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as exc:
        if all(_blank(f) for f in files):
            return []
        raise DataError(f"dataset '{path}' cannot be read: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
    return ds.to_list()


def _blank(path: str) -> bool:
    p = Path(path)
    return p.stat().st_size == 0 or (p.suffix != ".parquet" and p.stat().st_size < 4096 and not p.read_text().strip())


def load_prompts(cfg: Any, tokenizer: Any, rows: list[dict[str, Any]] | None = None) -> PromptSet:
    """Read (or take ``rows``), template and tokenize every prompt; check keys and emptiness first."""
    from .tiny_model import TASK_FILE

    path = "the given rows" if rows is not None else (cfg.path or TASK_FILE)
    if rows is None:
        rows = read_rows(path)
    if not rows:
        raise DataError(f"dataset '{path}' is empty; it needs at least one row with a '{cfg.prompt_key}' field")
    if cfg.prompt_key not in rows[0]:
        raise DataError(
            f"dataset '{path}' has no '{cfg.prompt_key}' column (columns: {', '.join(rows[0])}); "
            "set --data.prompt_key"
        )
    if cfg.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError("the model's tokenizer has no chat template; set --data.apply_chat_template false")
    prompts, ids, dropped = [], [], 0
    columns: dict[str, list[Any]] = {}
    for row in rows:
        prompt = row[cfg.prompt_key]
        if prompt is None or prompt == "" or prompt == []:
            dropped += 1
            continue
        tokens = encode_prompt(prompt, tokenizer, cfg.apply_chat_template)
        if len(tokens) > cfg.max_prompt_tokens:
            dropped += 1
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
    if dropped:
        logger.warning("dropped %d of %d prompts (empty or longer than %d tokens)", dropped, len(rows), cfg.max_prompt_tokens)
    return PromptSet(prompts, ids, columns, dropped)


def encode_prompt(prompt: Any, tokenizer: Any, chat: bool) -> list[int]:
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if not isinstance(prompt, str):
        raise DataError("a chat-message prompt needs --data.apply_chat_template true")
    return tokenizer(prompt)["input_ids"]


class PromptSampler:
    """Seeded epochs over the prompt set; its position is part of a checkpoint."""

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        import torch

        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.cursor >= self.size:
                self.epoch += 1
                self.cursor = 0
                self._order = self._permutation()
            step = min(k - len(out), self.size - self.cursor)
            out.extend(self._order[self.cursor : self.cursor + step])
            self.cursor += step
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._permutation()
