"""The ``rlhf`` command: ``rlhf train``, ``rlhf config``, ``rlhf plugins`` and the commands of
:mod:`rlhf_plugins.commands`.

User mistakes print one line (``rlhf: error: ...``) and exit with status 2;
``-v`` adds the traceback. Heavy libraries load only when training starts, so
``rlhf --help`` and ``rlhf plugins`` stay fast.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
import traceback
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape

from ._version import __version__
from .commands import convert, evaluate, runs, samples, serve_reward, stages
from .errors import Interrupted, UsageError
from .terminal import logger, quiet_third_party, setup_logging

#: subcommands with a module of their own: ``add_parser(sub, plugin_args)`` and
#: ``run(args, rest, console)`` (``rest``: the dotted config flags, for commands that take them)
COMMANDS = {"eval": evaluate, "runs": runs, "plot": runs, "samples": samples, "serve-reward": serve_reward,
            "convert": convert,
            **{stage: stages for stage in stages.STAGES}}



class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, status 2
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser(train_epilog: str | None = None) -> argparse.ArgumentParser:
    """``train_epilog``: the config key reference ``rlhf train --help`` prints (built only then)."""
    parser = _Parser(prog="rlhf", allow_abbrev=False, description="RLHF for LLMs where every part of the RL loop is a "
                                                                  "plugin.")
    parser.add_argument("--version", action="version", version=f"rlhf-plugins {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    train = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="train a policy (no arguments: the embedded tiny default)",
        description=textwrap.fill(
            "Train with RL. Every config key is a flag: --section.key VALUE "
            "(e.g. --algo.advantage.estimator rloo --train.steps 50); all of them are listed below, with "
            "those of the plugins given with --plugin. With no arguments it trains the embedded tiny Llama on "
            "the built-in addition task.", 100
        ),
        epilog=train_epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", metavar="FILE", help="YAML config; flags override it")
    train.add_argument("--trl-config", metavar="FILE",
                       help="a TRL GRPOConfig YAML (as for `trl grpo --config`); --config and flags override it")
    train.add_argument("--trl-trainer", choices=["grpo", "rloo"], default="grpo",
                       help="whose config --trl-config holds: grpo (GRPOConfig) or rloo (RLOOConfig, `trl rloo`)")
    train.add_argument("--resume", metavar="RUN_DIR",
                       help="continue a run from its latest complete checkpoint (or from a checkpoint folder); "
                            "flags may extend --train.steps")
    _plugin_args(train)
    train.add_argument("--dry-run", action="store_true", help="validate and print the config, then stop")
    train.add_argument("-v", "--verbose", action="store_true", help="debug logging and tracebacks")

    config = sub.add_parser("config", allow_abbrev=False, help="print a commented YAML config of every key (or one "
                                                               "section)",
                            description="Print every config key at its default, with its type, range and meaning, as "
                                        "YAML that --config accepts: rlhf config > run.yaml, edit, rlhf train --config "
                                        "run.yaml.")
    config.add_argument("section", nargs="?", help="one section only (e.g. algo, eval, ray, lora)")
    _plugin_args(config)

    plugins = sub.add_parser("plugins", allow_abbrev=False, help="list installed plugins and components")
    _plugin_args(plugins)
    plugins.add_argument("--components", action="store_true", help="list components by area instead")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.add_argument("-v", "--verbose", action="store_true", help="tracebacks of broken plugins")
    for module in dict.fromkeys(COMMANDS.values()):  # a module may add several commands
        module.add_parser(sub, _plugin_args)
    return parser


def _plugin_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-p",
        "--plugin",
        action="append",
        default=[],
        metavar="NAME",
        help="load a plugin: entry-point name, module, or path to a .py file; no:NAME blocks one (repeatable)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # the `rlhf` command: this process is ours (a caller passing argv keeps its own)
        from .training.host_memory import claim_process

        claim_process()
    argv = list(sys.argv[1:] if argv is None else argv)
    console = Console(stderr=False)
    verbose = "-v" in argv or "--verbose" in argv
    setup_logging(verbose)
    if not verbose:
        quiet_third_party()
    try:
        wants_help = argv[:1] == ["train"] and ("-h" in argv or "--help" in argv)
        parser = build_parser(config_reference(_plugins_named(argv)) if wants_help else None)
        args, rest = parser.parse_known_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        if args.command in ("plugins", "config"):
            if rest:
                raise UsageError(f"unrecognized arguments: {' '.join(rest)}")
            return cmd_plugins(args, console) if args.command == "plugins" else cmd_config(args)
        if args.command in COMMANDS:
            return COMMANDS[args.command].run(args, rest, console)
        return cmd_train(args, rest, console)
    except UsageError as exc:
        if verbose:
            traceback.print_exc()
        Console(stderr=True).print(f"[bold red]rlhf: error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return exc.exit_code
    except Interrupted as exc:
        Console(stderr=True).print(f"rlhf: {escape(str(exc))}", highlight=False, soft_wrap=True)
        return exc.exit_code
    except KeyboardInterrupt:
        Console(stderr=True).print("rlhf: interrupted")
        return 130


def _plugins_named(argv: list[str]) -> list[str]:
    """The ``-p/--plugin`` values of a command line (before argparse runs)."""
    out = []
    for i, arg in enumerate(argv):
        if arg in ("-p", "--plugin") and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif arg.startswith("--plugin="):
            out.append(arg.split("=", 1)[1])
    return out


def _schema(plugins: list[str]) -> list[Any]:
    from .config.options import OptionRegistry
    from .config.reference import sections
    from .core.manager import create_manager

    options = OptionRegistry()
    create_manager(plugins).add_options(options)
    return sections(options)


def config_reference(plugins: list[str]) -> str:
    from .config.reference import help_text

    return help_text(_schema(plugins))


def cmd_config(args: argparse.Namespace) -> int:
    from .config.reference import yaml_template

    secs = _schema(args.plugin)
    names = [s.name for s in secs]
    if args.section is not None and args.section not in names:
        raise UsageError(f"unknown config section '{args.section}'; choose one of: {', '.join(names)}")
    sys.stdout.write(yaml_template(secs, args.section))
    return 0


def cmd_plugins(args: argparse.Namespace, console: Console) -> int:
    from .core.manager import create_manager

    pm = create_manager(args.plugin)
    rows = pm.plugin_rows()
    components = [
        {
            "area": r.area,
            "name": r.name,
            "provider": r.provider,
            "available": r.component.available,
            "install": None if r.component.available else r.component.install_hint(),
            "description": r.component.description,
        }
        for r in pm.components
    ]
    if args.json:
        print(json.dumps({"plugins": rows, "components": components, "warnings": pm.warnings}, indent=2))
        return 0
    from rich.table import Table

    if args.components:
        table = Table(title="rlhf components")
        for col in ("area", "name", "provider", "available", "description"):
            table.add_column(col)
        for c in components:
            avail = "[green]yes[/]" if c["available"] else f"[red]no[/]: {escape(c['install'])}"
            table.add_row(c["area"], escape(c["name"]), escape(c["provider"]), avail, escape(c["description"]))
    else:
        table = Table(title="rlhf plugins")
        for col in ("name", "version", "source", "hooks"):
            table.add_column(col)
        for r in rows:
            hooks = ", ".join(h.removeprefix("rlhf_") for h in r["hooks"])
            table.add_row(escape(r["name"]), escape(r["version"]), r["source"], hooks)
    console.print(table)
    return 0


def load_config(args: argparse.Namespace, rest: list[str]) -> tuple[Any, Any, Any]:
    """YAML + flags -> (config, plugin manager, plan), all checked before anything starts."""
    from .api import prepare
    from .config.loading import load_yaml, merge, parse_overrides

    raw: dict[str, Any] = {}
    plugins = list(args.plugin)
    if getattr(args, "resume", None):
        from .api import prepare_resume

        if args.trl_config:
            raise UsageError("--resume continues a run with its own saved config; drop --trl-config")
        extra = load_yaml(args.config) if args.config else {}
        return prepare_resume(args.resume, merge(extra, parse_overrides(rest)), plugins)
    trainer = getattr(args, "trl_trainer", "grpo")
    if trainer != "grpo" and not args.trl_config:
        raise UsageError(f"--trl-trainer {trainer} says whose config --trl-config holds; give --trl-config FILE")
    if args.trl_config:
        from .integrations.trl import from_trl_yaml

        raw, notes, trl_plugins = from_trl_yaml(args.trl_config, trainer)
        plugins = trl_plugins + plugins
        for note in notes:
            logger.warning(note)
    if args.config:
        raw = merge(raw, load_yaml(args.config))
    return prepare(merge(raw, parse_overrides(rest)), plugins)


def cmd_train(args: argparse.Namespace, rest: list[str], console: Console) -> int:
    from .api import offline_defaults

    offline_defaults()
    config, pm, plan = load_config(args, rest)
    from rich.syntax import Syntax

    console.rule("[bold]rlhf train")
    console.print(Syntax(config.to_yaml(), "yaml", background_color="default"))
    for warning in pm.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    installed = [f"{i.name} {i.version} ({i.location})" for i in pm.infos.values()
                 if i.source == "entry point" and i.name not in pm.requested]
    if installed:
        console.print(f"installed plugins loaded: {escape(', '.join(installed))}", highlight=False, soft_wrap=True)
    for note in plan.notes:
        console.print(f"note: {escape(note)}", highlight=False, soft_wrap=True)
    if args.dry_run:
        from .training.run import plan_memory

        plan_memory(config, plan, console)
        console.print("[green]config is valid[/] (dry run: nothing started)")
        return 0
    from .training.run import run_training

    run_training(config, pm, plan, console, resume=getattr(plan, "resume", None))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
