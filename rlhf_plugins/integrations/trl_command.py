"""TRL's own command line -- ``trl grpo`` / ``trl rloo`` with field flags (``--learning_rate 1e-6 --use_vllm
--reward_funcs accuracy_reward think_format_reward``), with or without ``--config FILE`` -- as the fields TRL's
script would set. TRL's own parser for the script (``trl.scripts.<trainer>.make_parser``) reads the flags, so
each is typed as there (a bare boolean flag is true, a list takes the words after it); a flag overrides the
file's field, as ``TrlParser`` lets it."""
from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

from ..errors import UsageError


def command_fields(flags: list[str], trainer: str) -> dict[str, Any]:
    """The fields ``flags`` (``trl <trainer>``'s arguments but ``--config FILE``) set, typed by TRL's parser."""
    try:
        parser = importlib.import_module(f"trl.scripts.{trainer}").make_parser()
    except (ImportError, AttributeError) as exc:  # a TRL release without the script
        raise UsageError(f"this TRL has no `trl {trainer}` script to read its flags ({exc}); put the fields in a "
                         f"YAML file: rlhf convert trl {trainer} FILE.yaml") from None
    for action in parser._actions:  # only what the command line gives: no defaults, nothing required
        if action.dest != "help":
            action.default = argparse.SUPPRESS
            action.required = False

    def fail(message: str) -> None:
        raise UsageError(f"trl {trainer}: {message}")

    parser.error = fail  # argparse's own line (a value of the wrong type, a flag without its value), not its exit
    given, unknown = parser.parse_known_args(flags)
    if unknown:
        raise UsageError(f"trl {trainer} takes no {' '.join(unknown)} (not a field of its script, GRPOConfig / "
                         "RLOOConfig or ModelConfig); check the spelling")
    fields = vars(given)
    for key, value in fields.items():  # a dict field given as JSON, which TrainingArguments parses so
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                fields[key] = json.loads(value)
            except ValueError as exc:
                raise UsageError(f"trl {trainer}: --{key} {value} is not valid JSON ({exc})") from None
    return fields
