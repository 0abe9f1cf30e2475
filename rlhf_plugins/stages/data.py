"""Data of the stages: embedded demonstrations and preference pairs made for the default task, or
the user's files with their columns checked; always a training set and a held-out set."""
from __future__ import annotations

import logging
import random
from typing import Any

from ..data.prompts import fill_template, read_rows
from ..errors import DataError
from .config import StageConfig

logger = logging.getLogger("rlhf_plugins")


def _user(prompt: Any) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def _assistant(text: Any) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}] if isinstance(text, str) else list(text)


def demonstrations(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Addition rows -> TRL's conversational prompt/completion rows."""
    return [{"prompt": _user(r["prompt"]), "completion": _assistant(r["label"])} for r in rows]


def preference_pairs(rows: list[dict[str, Any]], per_prompt: int, seed: int,
                     markers: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Addition rows -> (the right sum, a worse answer) pairs: ``per_prompt`` wrong sums each, and,
    with the tokenizer's turn ``markers``, answers that run on past their turn (the right sum
    followed by a marker and more), which a policy otherwise learns to exploit."""
    rng = random.Random(seed)
    out = []
    for r in rows:
        wrong = [str(x) for x in range(19) if str(x) != r["label"]]
        rejected = rng.sample(wrong, min(per_prompt, len(wrong)))
        for marker in markers:
            rejected += [f"{r['label']}{marker}{rng.choice(wrong)}", f"{rng.choice(wrong)}{marker}{r['label']}"]
        out += [{"prompt": _user(r["prompt"]), "chosen": _assistant(r["label"]), "rejected": _assistant(a)}
                for a in rejected]
    return out


def turn_markers(tokenizer: Any) -> tuple[str, ...]:
    """Special tokens a completion should never contain (role markers), for run-on negatives."""
    skip = {tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token}
    special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return tuple(sorted(t for t in special | set(tokenizer.all_special_tokens) if t not in skip))


def _require(rows: list[dict[str, Any]], keys: list[str], path: str) -> None:
    if not rows:
        raise DataError(f"dataset '{path}' is empty")
    for key in keys:
        if key not in rows[0]:
            raise DataError(f"dataset '{path}' has no '{key}' column (columns: {', '.join(rows[0])}); "
                            f"set --data.{_flag(key)}")


def _flag(key: str) -> str:
    return {"completion": "completion_key", "chosen": "chosen_key", "rejected": "rejected_key",
            "label": "label_key"}.get(key, "prompt_key")


def _columns(stage: str, rows: list[dict[str, Any]], d: Any, path: str) -> dict[str, str]:
    """TRL's column -> the file's, for the stage: SFT's demonstrations (or ``messages`` or ``text`` rows), preference
    pairs, for KTO pairs or unpaired rows (a completion and whether it is desirable), distillation's prompts."""
    if stage == "distill":  # the student writes the answers: any other column is left unread
        _require(rows, [d.prompt_key], path)
        return {"prompt": d.prompt_key}
    if stage == "sft":
        if rows and "messages" in rows[0]:
            return {"messages": "messages"}
        if rows and "text" in rows[0] and d.prompt_key not in rows[0]:  # TRL's language-modelling rows
            return {"text": "text"}
        _require(rows, [d.prompt_key, d.completion_key], path)
        return {"prompt": d.prompt_key, "completion": d.completion_key}
    if stage == "kto" and rows and not (d.chosen_key in rows[0] and d.rejected_key in rows[0]):
        _require(rows, [d.prompt_key, d.completion_key, d.label_key], path)
        return {"prompt": d.prompt_key, "completion": d.completion_key, "label": d.label_key}
    if rows and d.prompt_key == "prompt" and d.prompt_key not in rows[0]:  # the prompt implicit in both answers
        _require(rows, [d.chosen_key, d.rejected_key], path)
        return {"chosen": d.chosen_key, "rejected": d.rejected_key}
    _require(rows, [d.prompt_key, d.chosen_key, d.rejected_key], path)
    return {"prompt": d.prompt_key, "chosen": d.chosen_key, "rejected": d.rejected_key}


def _desirable(value: Any, path: str) -> bool:
    """A KTO label: true / false, 1 / 0 (as JSON or text)."""
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise DataError(f"dataset '{path}' has a label {value!r}: a KTO label says whether the completion is desirable "
                    "(true / false, or 1 / 0); mend the row, or point --data.label_key at the column that says so")


def _pick(rows: list[dict[str, Any]], keys: dict[str, str], template: str | None, path: str) -> list[dict[str, Any]]:
    """The rows in TRL's column names (a KTO label as a bool), their prompts templated. Preference rows without
    a prompt column (whole conversations, or texts, that start alike) get the turns or text both answers start
    with as their prompt, as TRL's trainers take them (OpenRLHF's, without --prompt_key, train on the whole)."""
    picked = [{ours: r[theirs] for ours, theirs in keys.items()} for r in rows]
    if "chosen" in keys and "prompt" not in keys:
        from trl.data_utils import extract_prompt

        picked = [extract_prompt(r) for r in picked]
    if "label" in keys:
        picked = [{**r, "label": _desirable(r["label"], path)} for r in picked]
    return templated(picked, template, path)


def _split(rows: list[dict[str, Any]], fraction: float, seed: int) -> tuple[list, list]:
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n = max(1, int(round(len(rows) * fraction))) if fraction > 0 and len(rows) > 1 else 0
    held = set(order[:n])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def templated(rows: list[dict[str, Any]], template: str | None, path: str) -> list[dict[str, Any]]:
    """Rows whose plain-text prompts sit in ``template`` (OpenRLHF's --input_template); a template
    that no prompt can take (chat messages, which the chat template renders) is one line."""
    if template is None:
        return rows
    if not any(isinstance(r.get("prompt"), str) for r in rows):
        raise DataError(f"data.input_template puts plain-text prompts in place, but the prompts of '{path}' are chat "
                        "messages, which the chat template renders; drop --data.input_template")
    return [{**r, "prompt": fill_template(template, r["prompt"])} if "prompt" in r else r for r in rows]


def load(stage: str, cfg: StageConfig, tokenizer: Any = None
         ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, int]]:
    """(training rows, held-out rows, counts to report) in TRL's column names (KTO's embedded data: the
    preference pairs, which TRL's KTOTrainer splits into a desirable and an undesirable row each)."""
    from ..models.tiny_model import task_rows

    d, seed = cfg.data, cfg.train.seed
    if d.path is None:
        train, held = task_rows("train"), task_rows("test")
        if stage == "sft":
            return demonstrations(train), demonstrations(held), {}
        if stage == "distill":
            return [{"prompt": r["prompt"]} for r in demonstrations(train)], demonstrations(held), {}
        markers = turn_markers(tokenizer) if tokenizer is not None else ()
        return (preference_pairs(train, d.pairs_per_prompt, seed, markers), preference_pairs(held, 4, seed + 1), {})
    rows = read_rows(d.path, d.probs, seed, d.max_samples)
    keys = _columns(stage, rows, d, d.path)
    rows = _pick(rows, keys, d.input_template, d.path)
    counts: dict[str, int] = {}
    if "chosen" in keys:
        same = [r for r in rows if r["chosen"] == r["rejected"]]
        if same:
            logger.warning("%d of %d preference rows in '%s' have chosen == rejected; they carry no preference and "
                           "are left out", len(same), len(rows), d.path)
            rows = [r for r in rows if r["chosen"] != r["rejected"]]
            counts["dropped_equal_pairs"] = len(same)
        if not rows:
            raise DataError(f"dataset '{d.path}' has no preference row with chosen != rejected")
    if d.eval_path:
        held_rows = read_rows(d.eval_path)
        _require(held_rows, list(keys.values()), d.eval_path)
        return rows, _pick(held_rows, keys, d.input_template, d.eval_path), counts
    train, held = _split(rows, d.eval_split, seed)
    return train, held, counts
