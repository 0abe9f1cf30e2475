"""``rlhf convert trl [grpo|rloo] FILE.yaml [-o FILE]``: a ``trl grpo --config`` YAML (TRL's GRPOConfig fields,
the script's ``model_name_or_path`` / ``dataset_name`` / ``reward_funcs``, open-r1's), or with ``rloo`` a ``trl
rloo --config`` one (RLOOConfig's), as this project's own YAML config -- what ``rlhf train --trl-config FILE.yaml``
(``--trl-trainer rloo``) runs, written out to read and edit, with the conversion's notes as comments. TRL's own
command line converts too: ``rlhf convert trl -- trl rloo --config rloo.yaml``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import UsageError


def arguments(argv: list[str], output: Path | None) -> tuple[Path, Path | None, str]:
    """(the TRL YAML, where the config goes, the trainer) from ``trl`` 's arguments: the file, ``-o FILE`` and
    the trainer (grpo, the default, or rloo) in any order, or TRL's command line (``trl rloo --config FILE``)."""
    from ..integrations.trl_config import TRAINERS

    files, rest, trainers = [], list(argv), []
    while rest:
        token = rest.pop(0)
        if token in ("-o", "--output") or token.startswith("--output="):
            value = token.partition("=")[2] if "=" in token else (rest.pop(0) if rest else "")
            if not value:
                raise UsageError(f"{token} needs a file name, e.g. rlhf convert trl grpo.yaml -o config.yaml")
            output = Path(value)
        elif token in TRAINERS:
            trainers.append(token)
        elif token not in ("--", "trl", "--config"):
            files.append(token.removeprefix("--config="))
    if len(files) != 1 or len(trainers) > 1:
        got = [*trainers, *files]
        raise UsageError("give one TRL YAML file, and rloo before it for a trl rloo config, e.g. rlhf convert trl "
                         "grpo.yaml -o config.yaml" + (f" (got {', '.join(got)})" if got else ""))
    return Path(files[0]), output, (trainers or ["grpo"])[0]


def render_trl(source: Path, trainer: str = "grpo") -> str:
    """Our YAML config for the TRL YAML at ``source`` (of ``trainer``'s config): a header saying how to run
    it, one comment per note of the conversion, then the config (its ``plugins`` the reward functions'
    modules)."""
    from ..integrations.trl import from_trl_yaml

    raw, notes, plugins = from_trl_yaml(source, trainer)
    config: dict[str, Any] = {**raw, **({"plugins": plugins} if plugins else {})}
    lines = [f"# rlhf train --config this.yaml   (converted from the TRL {trainer.upper()} config {source.name} by "
             "`rlhf convert trl`)", *(f"# note: {note}" for note in notes)]
    return "\n".join(lines) + "\n" + yaml.safe_dump(config, sort_keys=False)

