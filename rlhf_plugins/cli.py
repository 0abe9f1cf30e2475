"""The ``rlhf`` command: ``rlhf train`` and ``rlhf plugins``.

User mistakes print one line (``rlhf: error: ...``) and exit with status 2;
``-v`` adds the traceback. Heavy libraries load only when training starts, so
``rlhf --help`` and ``rlhf plugins`` stay fast.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape

from ._version import __version__
from .errors import UsageError

logger = logging.getLogger("rlhf_plugins")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, status 2
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rlhf", allow_abbrev=False, description="RLHF for LLMs where every part of the RL loop is a plugin.")
    parser.add_argument("--version", action="version", version=f"rlhf-plugins {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    train = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="train a policy (no arguments: the embedded tiny default)",
        description=(
            "Train with RL. Every config key is a flag: --section.key VALUE "
            "(e.g. --algo.advantage.estimator rloo --train.steps 50). "
            "With no arguments it trains the embedded tiny Llama on the built-in addition task."
        ),
    )
    train.add_argument("--config", metavar="FILE", help="YAML config; flags override it")
    train.add_argument("--trl-config", metavar="FILE",
                       help="a TRL GRPOConfig YAML (as for `trl grpo --config`); --config and flags override it")
    _plugin_args(train)
    train.add_argument("--dry-run", action="store_true", help="validate and print the config, then stop")
    train.add_argument("-v", "--verbose", action="store_true", help="debug logging and tracebacks")

    plugins = sub.add_parser("plugins", allow_abbrev=False, help="list installed plugins and components")
    _plugin_args(plugins)
    plugins.add_argument("--components", action="store_true", help="list components by area instead")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.add_argument("-v", "--verbose", action="store_true", help="tracebacks of broken plugins")
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
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    console = Console(stderr=False)
    verbose = "-v" in argv or "--verbose" in argv
    _setup_logging(verbose)
    try:
        args, rest = parser.parse_known_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        if args.command == "plugins":
            if rest:
                raise UsageError(f"unrecognized arguments: {' '.join(rest)}")
            return cmd_plugins(args, console)
        return cmd_train(args, rest, console)
    except UsageError as exc:
        if verbose:
            traceback.print_exc()
        Console(stderr=True).print(f"[bold red]rlhf: error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return exc.exit_code
    except KeyboardInterrupt:
        Console(stderr=True).print("rlhf: interrupted")
        return 130


def _setup_logging(verbose: bool) -> None:
    from rich.logging import RichHandler

    if not logger.handlers:
        handler = RichHandler(show_time=False, show_path=False, console=Console(stderr=True))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)


def cmd_plugins(args: argparse.Namespace, console: Console) -> int:
    from .manager import create_manager

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
    from .config_loading import load_yaml, merge, parse_overrides

    raw: dict[str, Any] = {}
    plugins = list(args.plugin)
    if args.trl_config:
        from .integrations.trl import from_trl_yaml

        raw, notes, trl_plugins = from_trl_yaml(args.trl_config)
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
    if args.dry_run:
        console.print("[green]config is valid[/] (dry run: nothing started)")
        return 0
    from .run import run_training

    run_training(config, pm, plan, console)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
