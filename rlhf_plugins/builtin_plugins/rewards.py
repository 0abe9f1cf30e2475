"""Builtin rule rewards."""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .._markers import hookimpl
from ..types import RewardFunction

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _answer(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


def _same(completion: str, label: Any) -> bool:
    label_text = str(label).strip()
    if _NUMBER.fullmatch(label_text):
        found = _NUMBER.match(_answer(completion))
        return found is not None and float(found.group()) == float(label_text)
    return _answer(completion) == label_text


def exact_match(prompts: list[Any], completions: list[str], label: list[Any] | None = None,
                **kwargs: Any) -> list[float]:
    """1.0 when the completion's answer equals the label (numbers compared by value), else 0.0."""
    if label is None:
        raise ValueError("exact_match needs a label column in the dataset (see --data.label_key)")
    return [1.0 if _same(c, lab) else 0.0 for c, lab in zip(completions, label)]


@hookimpl
def rlhf_reward_functions() -> Iterable[RewardFunction]:
    yield RewardFunction("exact_match", exact_match, description=exact_match.__doc__.splitlines()[0])


@hookimpl(trylast=True)
def rlhf_extract_answer(completion: str, sample: Any) -> Any:
    from ..evaluation.metrics import extract_answer

    return extract_answer(completion)
