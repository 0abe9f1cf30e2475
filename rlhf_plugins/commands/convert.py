"""``rlhf convert openrlhf -- <command line>``: an OpenRLHF command (``python3 -m openrlhf.cli.train_ppo_ray
--pretrain ... --actor_learning_rate 5e-7 ...``, ``deepspeed --module openrlhf.cli.train_sft ...``, or just
its flags) as a YAML config for the matching rlhf command, with OpenRLHF's defaults carried where ours
differ and every flag that could not be converted listed with the reason."""
from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config.loading import set_dotted
from ..config.openrlhf_flags import COMMANDS, NEARBY, OURS, PPO_DEFAULTS, Flag, lookup
from ..errors import UsageError
from .convert_correction import FLAGS as CORRECTION_FLAGS
from .convert_correction import convert_correction
from .convert_rules import drop_what_openrlhf_ignores
from .convert_stages import BY_HAND, STAGES, convert_stage, stage_key


@dataclass
class Converted:
    command: str = "ppo"
    raw: dict[str, Any] = field(default_factory=dict)
    #: (flag, why it was not converted)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: OpenRLHF defaults carried into the config
    carried: list[str] = field(default_factory=list)
    #: (flag, how ours differs) for flags converted to an equivalent with a difference
    partial: list[tuple[str, str]] = field(default_factory=list)
    set_keys: set[str] = field(default_factory=set)
    #: serve_rm: the arguments of the equivalent ``rlhf serve-reward`` command line
    serve: list[str] = field(default_factory=list)
    #: a flag's first spelling -> the spelling on the command line (notes name the one the user wrote)
    typed: dict[str, str] = field(default_factory=dict)

    def put(self, key: str, value: Any) -> None:
        set_dotted(self.raw, key, value)
        self.set_keys.add(key)


def split_command(argv: list[str]) -> tuple[str, list[str]]:
    """(our name of their command, their flags): the command from the ``openrlhf.cli.X`` module named
    on the line (train_ppo_ray when none is), the flags after it."""
    import re

    for i, token in enumerate(argv):
        named = re.search(r"openrlhf[./]cli[./](\w+?)(?:\.py)?$", token)
        if named is None:
            continue
        if named.group(1) not in COMMANDS:
            hint = NEARBY.get(named.group(1), "")
            raise UsageError(f"OpenRLHF's {named.group(1)} has no equivalent here: rlhf convert openrlhf converts "
                             f"{', '.join(COMMANDS)} (docs/from_openrlhf.md){hint}")
        return COMMANDS[named.group(1)], argv[i + 1:]
    first = next((i for i, t in enumerate(argv) if t.startswith("--")), len(argv))
    return "ppo", argv[first:]


def _values(flag: Flag | None, argv: list[str], i: int, inline: str | None) -> tuple[list[str], int]:
    """The flag's values and the index after them."""
    if inline is not None:
        return [inline], i + 1
    if flag is not None and flag.switch:
        return [], i + 1
    if flag is not None and isinstance(flag.nargs, int):
        return argv[i + 1:i + 1 + flag.nargs], i + 1 + flag.nargs
    j = i + 1
    while j < len(argv) and not (argv[j].startswith("--") and len(argv[j]) > 2):
        j += 1
    vals = argv[i + 1:j]
    if flag is None or flag.nargs == "*":
        return vals, j
    return vals[:1], i + 1 + min(1, len(vals))


def _scalar(text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, (dict, list)):  # OpenRLHF's argparse gives one value its text ("Q: {}" is a template)
        return text
    if isinstance(value, str):  # YAML 1.1 reads 5e-7 as text
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _value(flag: Flag, vals: list[str]) -> Any:
    if flag.switch or (flag.value is not None and not flag.nargs):
        return True if flag.value is None else flag.value
    parsed = [_scalar(v) for v in vals]
    if flag.map is not None:
        parsed = [flag.map.get(str(v), v) for v in parsed]
    if flag.nargs == "*":
        return [x for v in parsed for x in (str(v).split(",") if isinstance(v, str) else [v]) if x != ""]
    if flag.nargs == 2:
        return parsed
    return parsed[0] if parsed else None


def convert(argv: list[str]) -> Converted:
    command, flags = split_command(argv)
    out = Converted(command=command)
    roles: dict[str, dict[str, int]] = {}
    by_hand: dict[str, list[str]] = {}
    i = 0
    while i < len(flags):
        token = flags[i]
        if not token.startswith("--"):
            out.skipped.append((token, "not a flag (a positional argument of the launcher?)"))
            i += 1
            continue
        name, _, inline = token.partition("=")
        flag = lookup(name)
        vals, i = _values(flag, flags, i, inline if "=" in token else None)
        if flag is not None:
            out.typed[flag.flags[0]] = name
        if flag is None:
            out.skipped.append((name, "not a flag of OpenRLHF's train_ppo_ray / train_sft / train_rm / train_dpo / "
                                      "serve_rm (0.9-0.11)"))
        elif flag.kind == "none" and not (flag.stage and command in STAGES):
            out.skipped.append((name, flag.note))
        elif flag.role:
            role, what = flag.role.split(".")
            roles.setdefault(role, {})[what] = int(vals[0])
        elif (command in STAGES and flag.flags[0] in BY_HAND) or (command == "ppo" and
                                                                    flag.flags[0] in CORRECTION_FLAGS):
            by_hand[flag.flags[0]] = vals
        else:
            _apply(out, flag, name, vals)
    for role, counts in roles.items():
        out.put(f"ray.{role}_workers", counts.get("nodes", 1) * counts.get("gpus", 8))
    if command in STAGES:
        convert_stage(out, by_hand)
    if command == "ppo":
        _reward_file(out)
        convert_correction(out, {k: v for k, v in by_hand.items() if k in CORRECTION_FLAGS})
        if out.raw.get("vllm", {}).get("num_engines") == 0:
            out.raw["vllm"].pop("num_engines")
            out.put("generation.backend", "transformers")
        for key, value in PPO_DEFAULTS.items():
            if key not in out.set_keys:
                out.put(key, value)
                out.carried.append(f"{key}: {value}")
        drop_what_openrlhf_ignores(out)
        if out.raw["algo"]["advantage"]["estimator"] == "group_norm":  # OpenRLHF divides by std + 1e-9
            out.put("algo.advantage.std_eps", 1e-9)
            out.carried.append("algo.advantage.std_eps: 1e-09 (group_norm: std + 1e-9)")
    out.skipped = [(out.typed.get(flag, flag), why) for flag, why in out.skipped]
    out.partial = [(out.typed.get(flag, flag), how) for flag, how in out.partial]
    return out


def _reward_file(out: Converted) -> None:
    """OpenRLHF reads a --remote_rm_url ending in .py as a local file of ``reward_func(queries, prompts,
    labels)``: here that file is a plugin and its reward_func the run's reward function."""
    urls = out.raw.get("reward", {}).get("remote_urls") or []
    files = [u for u in urls if str(u).endswith(".py")]
    if not files:
        return
    out.raw["reward"]["remote_urls"] = [u for u in urls if u not in files]
    if not out.raw["reward"]["remote_urls"]:
        del out.raw["reward"]["remote_urls"]
    out.put("plugins", files[:1])
    out.put("reward.functions", ["reward_func"])
    out.partial.append(("--remote_rm_url", f"{files[0]} is a plugin here (plugins:) and its reward_func(queries, "
                                           "prompts, labels) the reward (reward.functions: [reward_func])"))
    for extra in files[1:]:
        out.skipped.append((f"--remote_rm_url {extra}", "one reward_func file per run, as in OpenRLHF"))


#: serve_rm's flags rlhf serve-reward does without, and why
SERVE_WHY = {"--value_head_prefix": "the value head is found by its name (score, or value_head)",
             "--max_len": "whole queries are scored"}


def _serve(out: Converted, flag: Flag, name: str, vals: list[str]) -> None:
    """One serve_rm flag as an argument of ``rlhf serve-reward``."""
    ours = flag.serve or (flag.ours[0] if flag.commands == ("serve_rm",) else None)
    value = ",".join(vals)
    if ours is None:
        why = flag.note if flag.kind == "none" and flag.note else SERVE_WHY.get(flag.flags[0], "no such option")
        out.skipped.append((name, why))
    elif ours == "--model" and "," in value:
        out.skipped.append((name, "one reward model per server: serve each on its own port"))
    else:
        out.serve += [*ours.split(), *([] if flag.switch else [value])]


def _apply(out: Converted, flag: Flag, name: str, vals: list[str]) -> None:
    """One flag into the config of ``out.command``."""
    if out.command == "serve_rm":
        _serve(out, flag, name, vals)
        return
    stage = out.command in STAGES
    if not flag.ours and not (stage and flag.stage):
        out.skipped.append((name, flag.note or "no equivalent here"))
        return
    unmapped = flag.unmapped([_scalar(v) for v in vals])
    if unmapped:  # a value OpenRLHF's release does not take, or one without an equivalent here
        out.skipped.append((name, unmapped))
        return
    if flag.kind == "partial" and flag.note:
        out.partial.append((name, flag.note))
    if stage and flag.stage:
        value = flag.stage_value if flag.stage_value is not None else _value(flag, vals)
        out.put(flag.stage, value)
        return
    keys = flag.ours
    if stage and not all(stage_key(k) for k in keys):
        out.skipped.append((name, f"no equivalent in {OURS[out.command]} (TRL's fields go under --trl.*)"))
        return
    value = _value(flag, vals)
    if len(keys) == 2 and not isinstance(value, list):
        value = [value, value]
    for key, v in zip(keys, value if len(keys) == 2 else [value]):
        out.put(key, v)
    for key, v in flag.sets.items():
        if key not in out.set_keys:
            out.put(key, v)


def render(conv: Converted) -> str:
    """The YAML config with a header saying how to run it, what was carried and what was not converted
    (serve_rm: the ``rlhf serve-reward`` command line instead of a config)."""
    run = "" if conv.command == "serve_rm" else " --config this.yaml"
    lines = [f"# {OURS[conv.command]}{run}   (converted from OpenRLHF's {conv.command} command by "
             "`rlhf convert openrlhf`)"]
    if conv.carried:
        lines.append("# OpenRLHF's defaults, carried where rlhf-plugins' differ: " + "; ".join(conv.carried))
    for flag, how in conv.partial:
        lines.append(f"# converted with a difference: {flag}: {how}")
    for flag, why in conv.skipped:
        lines.append(f"# not converted: {flag}: {why}")
    if conv.command == "serve_rm":
        return "\n".join([*lines, shlex.join(["rlhf", "serve-reward", *conv.serve])]) + "\n"
    return "\n".join(lines) + "\n" + yaml.safe_dump(conv.raw, sort_keys=False)


def add_parser(sub: Any, plugin_args: Any) -> None:
    p = sub.add_parser("convert", allow_abbrev=False,
                       help="an OpenRLHF command line or a TRL GRPO / RLOO YAML as a config",
                       description="rlhf convert openrlhf [-o FILE] -- <OpenRLHF command line>: the equivalent YAML "
                                   "config (run it with rlhf train --config FILE), OpenRLHF's defaults carried "
                                   "where ours differ, and the flags it could not convert, each with the reason. "
                                   "rlhf convert trl [rloo] FILE.yaml [-o FILE]: a `trl grpo --config` YAML (with "
                                   "rloo: `trl rloo --config`) as our config (what rlhf train --trl-config runs), its "
                                   "notes as comments.")
    p.add_argument("source", choices=["openrlhf", "trl"], help="whose command line or config")
    p.add_argument("-o", "--output", type=Path, help="write the config here (default: print it)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="the command line, after -- (trl: the YAML file)")


def _own_output(argv: list[str], output: Path | None) -> tuple[list[str], Path | None]:
    """``-o FILE`` written after ``openrlhf`` (``rlhf convert openrlhf -o FILE -- ...``, as the docs
    write it) lands in the remainder: take it back, up to the ``--`` that starts the command line."""
    while argv and (argv[0] in ("-o", "--output") or argv[0].startswith("--output=")):
        flag = argv.pop(0)
        value = flag.partition("=")[2] if "=" in flag else (argv.pop(0) if argv else "")
        if not value or value == "--":
            raise UsageError(f"{flag} needs a file name, e.g. rlhf convert openrlhf -o ppo.yaml -- python3 -m ...")
        output = Path(value)
    return (argv[1:] if argv[:1] == ["--"] else argv), output


def run(args: argparse.Namespace, rest: list[str], console: Any) -> int:
    if args.source == "trl":
        from .convert_trl import arguments, render_trl

        source, flags, args.output, trainer = arguments([*args.argv, *rest], args.output)
        text = render_trl(source, trainer, flags)
    else:
        argv, args.output = _own_output([*args.argv, *rest], args.output)
        if not argv:
            raise UsageError("give the OpenRLHF command line after --, e.g. rlhf convert openrlhf -- "
                             "python3 -m openrlhf.cli.train_ppo_ray --pretrain ...")
        text = render(convert(argv))
    if args.output:
        args.output.write_text(text)
        console.print(f"wrote {args.output}", highlight=False)
    else:
        print(text, end="")
    return 0
