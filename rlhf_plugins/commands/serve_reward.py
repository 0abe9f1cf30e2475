"""``rlhf serve-reward``: serve a reward model or a reward function over OpenRLHF's protocol."""
from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from rich.console import Console

from ..errors import UsageError


def add_parser(sub: Any, plugin_args: Any) -> None:
    p = sub.add_parser("serve-reward", allow_abbrev=False,
                       help="serve a reward model or reward function over HTTP (OpenRLHF's /get_reward)",
                       description="Serve a reward model (--model) or a registered reward function (--function, "
                                   "with --plugin) at POST /get_reward: {query, prompts, labels} -> {rewards}.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", metavar="PATH", help="a reward model folder (TRL or OpenRLHF format)")
    what.add_argument("--function", metavar="NAME", help="a reward function by name (see `rlhf plugins --components`)")
    plugin_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=16, help="queries scored together at most")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a request waits for others to batch with")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--normalize-reward", action="store_true",
                   help="apply the model's stored mean / std (OpenRLHF serve_rm's --normalize_reward)")
    p.add_argument("-v", "--verbose", action="store_true")


def run(args: argparse.Namespace, rest: list[str], console: Console) -> int:
    if rest:
        raise UsageError(f"unrecognized arguments: {' '.join(rest)}")
    for module, extra in (("fastapi", "serve"), ("uvicorn", "serve")):
        if importlib.util.find_spec(module) is None:
            raise UsageError(f"rlhf serve-reward needs {module}, which is not installed: "
                             f"pip install 'rlhf-plugins[{extra}]'")
    if args.batch_size < 1 or args.max_wait_ms < 0 or not 0 < args.port < 65536:
        raise UsageError("--batch-size must be >= 1, --max-wait-ms >= 0 and --port in 1..65535")
    from ..rewards.server import function_scorer, make_app, model_scorer
    from ..training.runlog import quiet_libraries

    quiet_libraries()

    if args.model:
        from ..models.reward_model import inspect_reward_model

        inspect_reward_model(args.model)
        score = model_scorer(args.model, args.dtype, args.batch_size, args.normalize_reward)
        what = f"reward model {args.model}"
    else:
        from ..core.manager import create_manager
        from ..types import RewardFunction

        pm = create_manager(args.plugin)
        comp = pm.components.get(RewardFunction, args.function)
        from ..config import Config

        score, what = function_scorer(comp.build(Config())), f"reward function '{args.function}'"
    import uvicorn

    console.print(f"serving {what} at http://{args.host}:{args.port}/get_reward (batches of up to {args.batch_size})",
                  highlight=False)
    uvicorn.run(make_app(score, args.batch_size, args.max_wait_ms), host=args.host, port=args.port,
                log_level="warning")
    return 0
