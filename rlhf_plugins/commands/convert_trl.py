"""``rlhf convert trl GRPO.yaml [-o FILE]``: a ``trl grpo --config`` YAML (TRL's GRPOConfig fields, the
script's ``model_name_or_path`` / ``dataset_name`` / ``reward_funcs``, open-r1's) as this project's own
YAML config -- what ``rlhf train --trl-config GRPO.yaml`` runs, written out to read and edit, with the
conversion's notes as comments."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import UsageError


def arguments(argv: list[str], output: Path | None) -> tuple[Path, Path | None]:
    """(the TRL YAML, where the config goes) from ``trl`` 's arguments: the file and ``-o FILE`` in any order."""
    files, rest = [], list(argv)
    while rest:
        token = rest.pop(0)
        if token in ("-o", "--output") or token.startswith("--output="):
            value = token.partition("=")[2] if "=" in token else (rest.pop(0) if rest else "")
            if not value:
                raise UsageError(f"{token} needs a file name, e.g. rlhf convert trl grpo.yaml -o config.yaml")
            output = Path(value)
        elif token != "--":
            files.append(token)
    if len(files) != 1:
        raise UsageError("give one TRL GRPO YAML file, e.g. rlhf convert trl grpo.yaml -o config.yaml"
                         + (f" (got {', '.join(files)})" if files else ""))
    return Path(files[0]), output


def render_trl(source: Path) -> str:
    """Our YAML config for the TRL YAML at ``source``: a header saying how to run it, one comment per
    note of the conversion, then the config (its ``plugins`` the reward functions' modules)."""
    from ..integrations.trl import from_trl_yaml

    raw, notes, plugins = from_trl_yaml(source)
    config: dict[str, Any] = {**raw, **({"plugins": plugins} if plugins else {})}
    lines = [f"# rlhf train --config this.yaml   (converted from the TRL GRPO config {source.name} by "
             "`rlhf convert trl`)", *(f"# note: {note}" for note in notes)]
    return "\n".join(lines) + "\n" + yaml.safe_dump(config, sort_keys=False)

