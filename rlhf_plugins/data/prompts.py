"""Prompt datasets: rows (``sources``) made prompts -- templated, tokenized, checked.

Each row gives a prompt (a string, or a list of chat messages) and optionally a
label; every column reaches the reward functions as a keyword argument (the
label column under the name ``label``).
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, DataError
from .sources import BUILTIN, builtin_rows, data_files, first_rows, read_rows

__all__ = ["PromptSet", "builtin_rows", "data_files", "first_rows", "load_prompts", "read_rows"]

logger = logging.getLogger("rlhf_plugins")


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


def load_prompts(cfg: Any, tokenizer: Any, rows: list[dict[str, Any]] | None = None,
                 name: str | None = None) -> PromptSet:
    """Read (or take ``rows``, read from ``name``), template and tokenize every prompt; check keys
    and emptiness first."""
    path = name or ("the given rows" if rows is not None else (cfg.path or DEFAULT_DATA))
    if rows is None:
        rows = read_rows(path)
    if not rows:
        raise DataError(f"dataset '{path}' is empty; it needs at least one row with a '{cfg.prompt_key}' field")
    if cfg.prompt_key not in rows[0]:
        raise DataError(
            f"dataset '{path}' has no '{cfg.prompt_key}' column (columns: {', '.join(rows[0])}); "
            "set --data.prompt_key"
        )
    templated = cfg.template_strings or any(not isinstance(r.get(cfg.prompt_key), str) for r in rows)
    if cfg.apply_chat_template and templated and not getattr(tokenizer, "chat_template", None):
        raise DataError("the model's tokenizer has no chat template; give one (--data.chat_template) or set "
                        "--data.apply_chat_template false")
    prompts, ids, dropped = [], [], 0
    empty = too_long = filled = systems = 0
    columns: dict[str, list[Any]] = {}
    for number, row in enumerate(rows, 1):
        prompt = row[cfg.prompt_key]
        if prompt is None or prompt == "" or prompt == []:
            dropped, empty = dropped + 1, empty + 1
            continue
        check_prompt(prompt, number, path, cfg.prompt_key)
        chat = cfg.apply_chat_template and (cfg.template_strings or not isinstance(prompt, str))
        if chat and getattr(cfg, "system_prompt", None):
            prompt, systems = with_system_prompt(prompt, cfg.system_prompt), systems + 1
        if cfg.input_template and not chat and isinstance(prompt, str):
            prompt, filled = cfg.input_template.format(prompt), filled + 1
        tokens = encode_prompt(prompt, tokenizer, chat, getattr(cfg, "chat_template_kwargs", None))
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
    if getattr(cfg, "system_prompt", None) and not systems:
        raise DataError(f"data.system_prompt opens the prompts the chat template renders, but every prompt of '{path}' "
                        "is plain text tokenized as it is (data.template_strings false); set --data.template_strings "
                        "true or drop --data.system_prompt")
    if dropped:
        why = [f"{empty} empty"] * bool(empty) + [f"{too_long} longer than --data.max_prompt_tokens "
                                                 f"{cfg.max_prompt_tokens}"] * bool(too_long)
        logger.warning("dropped %d of %d prompts (%s)", dropped, len(rows), ", ".join(why))
    return PromptSet(prompts, ids, columns, dropped)


def use_chat_template(tokenizer: Any, cfg: Any) -> None:
    """``--data.chat_template`` onto the tokenizer (the trained model's folder then keeps it), checked by
    rendering one user message."""
    if not getattr(cfg, "chat_template", None):
        return
    tokenizer.chat_template = chat_template_text(cfg.chat_template)
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True, tokenize=False,
                                      **cfg.chat_template_kwargs)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(f"data.chat_template does not render a user message: {type(exc).__name__}: {first}") from None


def chat_template_text(value: str) -> str:
    """A file's text, or the value itself when it is a Jinja template."""
    from pathlib import Path

    if "{" not in value and Path(value).is_file():
        return Path(value).read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"data.chat_template {value[:60]!r} is neither a file nor a Jinja template ({{{{ ... }}}}, "
                      "{% ... %})")


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


def with_system_prompt(prompt: Any, system: str) -> list[dict[str, Any]]:
    """A prompt as chat messages opening with ``system`` (unless it opens with a system message of its own)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if messages and messages[0].get("role") == "system":
        return messages
    return [{"role": "system", "content": system}, *messages]


def encode_prompt(prompt: Any, tokenizer: Any, chat: bool, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """A prompt's token ids: rendered by the chat template (with ``template_kwargs``) when ``chat``."""
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **(template_kwargs or {}))
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if not isinstance(prompt, str):
        raise DataError("a chat-message prompt needs --data.apply_chat_template true")
    return tokenizer(prompt)["input_ids"]
