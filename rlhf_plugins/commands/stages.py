"""``rlhf sft``, ``rlhf rm``, ``rlhf dpo``, ``rlhf kto``: the stages before RL, and ``rlhf distill``, through TRL's
trainers."""
from __future__ import annotations

import argparse
import tempfile
from typing import Any

from rich.console import Console

STAGES = {
    "sft": "supervised fine-tuning on demonstrations (TRL SFTTrainer)",
    "rm": "train a reward model on preference pairs (TRL RewardTrainer)",
    "dpo": "direct preference optimisation (TRL DPOTrainer)",
    "kto": "Kahneman-Tversky optimisation on desirable and undesirable answers (TRL KTOTrainer)",
    "distill": "on-policy distillation: the student matches a teacher's next-token distribution on its own samples "
               "(TRL DistillationTrainer)",
}
#: TRL's command of each stage (``trl reward --config``, ``trl distillation --config``)
TRL_COMMANDS = {"rm": "reward", "distill": "distillation"}


def add_parser(sub: Any, plugin_args: Any) -> None:
    for stage, what in STAGES.items():
        alone = ("With --model.teacher FOLDER alone (e.g. the final/ folder of rlhf sft) it distils into the "
                 "embedded tiny Llama on the default task's prompts." if stage == "distill" else
                 "With no arguments it trains the embedded tiny Llama on data made for the default task.")
        p = sub.add_parser(stage, allow_abbrev=False, help=what,
                           description=f"{what[0].upper()}{what[1:]}. Every config key is a flag (--section.key "
                                       "VALUE); TRL's own fields go under --trl.FIELD (e.g. --trl.learning_rate "
                                       f"1e-4). {alone}")
        p.add_argument("--config", metavar="FILE", help="YAML config; flags override it")
        p.add_argument("--trl-config", metavar="FILE",
                       help=f"a TRL YAML (as for `trl {TRL_COMMANDS.get(stage, stage)} --config`); --config and "
                            "flags override it")
        p.add_argument("--dry-run", action="store_true", help="validate and print the config, then stop")
        p.add_argument("-v", "--verbose", action="store_true", help="debug logging and tracebacks")


def run(args: argparse.Namespace, rest: list[str], console: Console) -> int:
    import yaml
    from rich.syntax import Syntax

    from ..api import offline_defaults
    from ..config.loading import build_dataclass, load_yaml, merge, parse_overrides
    from ..stages.config import StageConfig, check, trl_config

    offline_defaults()
    raw: dict[str, Any] = {}
    if args.trl_config:
        from ..integrations.trl_stage_yaml import from_trl_stage_yaml

        raw, notes = from_trl_stage_yaml(args.trl_config)
        for note in notes:
            console.print(f"[dim]{note}[/]", highlight=False)
    raw = merge(merge(raw, load_yaml(args.config) if args.config else {}), parse_overrides(rest))
    cfg = build_dataclass(raw, StageConfig)
    check(cfg, args.command)
    console.rule(f"[bold]rlhf {args.command}")
    console.print(Syntax(yaml.safe_dump(cfg.to_dict(), sort_keys=False), "yaml", background_color="default"))
    if args.dry_run:
        with tempfile.TemporaryDirectory() as tmp:
            trl_config(args.command, cfg, tmp)  # TRL checks its own fields
        console.print("[green]config is valid[/] (dry run: nothing started)")
        return 0
    from ..stages.runner import run_stage

    run_stage(args.command, cfg, console)
    return 0
