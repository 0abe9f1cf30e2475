"""``rlhf convert trl [grpo|rloo] FILE.yaml [-o FILE]``: a ``trl grpo --config`` YAML (TRL's GRPOConfig fields,
the script's ``model_name_or_path`` / ``dataset_name`` / ``reward_funcs``, open-r1's), or with ``rloo`` a ``trl
rloo --config`` one (RLOOConfig's), as this project's own YAML config -- what ``rlhf train --trl-config FILE.yaml``
(``--trl-trainer rloo``) runs, written out to read and edit, with the conversion's notes as comments. TRL's own
command line converts too, its field flags over the file's fields or alone: ``rlhf convert trl -- trl rloo
--config rloo.yaml --learning_rate 1e-6``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import UsageError


def arguments(argv: list[str], output: Path | None) -> tuple[Path | None, list[str], Path | None, str]:
    """(the TRL YAML, TRL's flags, where the config goes, the trainer) from ``trl`` 's arguments: the file, ``-o FILE``
    and the trainer (grpo, the default, or rloo) in any order, or TRL's command line after ``--`` (``trl grpo
    [--config FILE] [--field value ...]``: what follows ``trl`` is its own)."""
    from ..integrations.trl_config import TRAINERS

    files, rest, trainers, flags = [], list(argv), [], []
    while rest:
        token = rest.pop(0)
        if token == "trl":  # TRL's command line: its trainer, then its arguments
            if rest and rest[0] in TRAINERS:
                trainers.append(rest.pop(0))
            files_given, flags = _trl_command(rest)
            files += files_given
            break
        if token in ("-o", "--output") or token.startswith("--output="):
            value = token.partition("=")[2] if "=" in token else (rest.pop(0) if rest else "")
            if not value:
                raise UsageError(f"{token} needs a file name, e.g. rlhf convert trl grpo.yaml -o config.yaml")
            output = Path(value)
        elif token in TRAINERS:
            trainers.append(token)
        elif token not in ("--", "--config"):
            files.append(token.removeprefix("--config="))
    if len(files) > 1 or (not files and not flags) or len(trainers) > 1:
        got = [*trainers, *files]
        raise UsageError("give one TRL YAML file, and rloo before it for a trl rloo config, e.g. rlhf convert trl "
                         "grpo.yaml -o config.yaml, or TRL's command line: rlhf convert trl -- trl grpo --config "
                         "grpo.yaml --learning_rate 1e-6" + (f" (got {', '.join(got)})" if got else ""))
    return (Path(files[0]) if files else None), flags, output, (trainers or ["grpo"])[0]


def _trl_command(tokens: list[str]) -> tuple[list[str], list[str]]:
    """TRL's arguments -> (its ``--config`` files, the rest: field flags)."""
    files, flags = [], []
    while tokens:
        token = tokens.pop(0)
        if token == "--config":
            if not tokens:
                raise UsageError("trl's --config needs a file name, e.g. trl grpo --config grpo.yaml")
            files.append(tokens.pop(0))
        elif token.startswith("--config="):
            files.append(token.partition("=")[2])
        else:
            flags.append(token)
    return files, flags


def render_trl(source: Path | None, trainer: str = "grpo", flags: list[str] | None = None) -> str:
    """Our YAML config for the TRL YAML at ``source`` (of ``trainer``'s config) and TRL's ``flags`` over it: a
    header saying how to run it, one comment per note of the conversion, then the config (its ``plugins`` the
    reward functions' modules)."""
    from ..integrations.trl import from_trl_yaml
    from ..integrations.trl_command import command_fields

    fields = command_fields(flags, trainer) if flags else None
    raw, notes, plugins = from_trl_yaml(source, trainer, fields)
    config: dict[str, Any] = {**raw, **({"plugins": plugins} if plugins else {})}
    given = f" --config {source.name}" if source is not None else ""
    what = (f"command line (trl {trainer}{given} and {len(fields)} flag{'s' * (len(fields) > 1)})" if fields
            else f"config {source.name}")  # arguments() gives a file where it gives no flags
    lines = [f"# rlhf train --config this.yaml   (converted from the TRL {trainer.upper()} {what} by "
             "`rlhf convert trl`)", *(f"# note: {note}" for note in notes)]
    return "\n".join(lines) + "\n" + yaml.safe_dump(config, sort_keys=False)

