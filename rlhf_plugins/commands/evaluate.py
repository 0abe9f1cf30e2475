"""``rlhf eval``: the held-out evaluation of a run, standalone, on a saved policy or a run directory.

``rlhf eval --model runs/x`` evaluates ``runs/x/final`` with the run's own config (data columns,
reward, evaluation settings, plugins); ``--model runs/x/best`` its best policy; ``--model PATH``
any ``save_pretrained`` folder with the default config. Config flags apply as for ``rlhf train``
(``--eval.n_samples 16``, ``--generation.backend vllm``, ``--placement.strategy ray``). The
report is JSON: the metrics, the model, the data and the evaluation settings.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from ..errors import UsageError, hub_download


def add_parser(sub: Any, plugin_args: Any) -> None:
    p = sub.add_parser("eval", allow_abbrev=False, help="evaluate a saved policy or a run on held-out prompts",
                       description="Held-out evaluation (pass@1, pass@k, mean@k, maj@k, greedy) of a saved policy or a "
                                   "run directory, through the same engines as training. Every config key is a flag "
                                   "(--eval.n_samples 16). With no arguments: the default model on the default task's "
                                   "test split. `rlhf eval RUN_DIR` is `rlhf eval --model RUN_DIR`.")
    p.add_argument("--model", metavar="PATH", help="a run directory (its final/ policy and its config), a run's best/ "
                                                   "or final/ folder, or any save_pretrained folder")
    p.add_argument("--data", metavar="PATH", help="held-out prompts (file, folder or builtin:NAME); default: the run's "
                                                  "own held-out data")
    p.add_argument("--output", metavar="FILE", default="eval.json", help="where the JSON report goes (default: "
                                                                         "eval.json)")
    p.add_argument("--config", metavar="FILE", help="YAML config; flags override it")
    plugin_args(p)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging and tracebacks")


def model_and_config(model: str | None) -> tuple[str | None, str | None, dict[str, Any]]:
    """(policy folder, a LoRA adapter folder to load onto it or None, the run's saved config or {})
    for what ``--model`` names."""
    from ..config.loading import load_yaml

    if model is None:
        return None, None, {}
    path = Path(model).expanduser()
    if not path.is_dir():
        hub = hub_download(model)
        raise UsageError(f"--model '{model}' does not exist here; {hub} and give DIR" if hub else
                         f"--model '{model}' is not a folder; give a run directory or a save_pretrained folder")
    if not any((path / name).is_file() for name in ("config.yaml", "config.json", "adapter_config.json")):
        from ..training.runlog import runs_inside

        raise UsageError(f"--model '{model}' is neither a run directory (config.yaml) nor a save_pretrained folder "
                         f"(config.json){runs_inside(path)}; give one")
    if (path / "config.yaml").is_file():
        final = path / "final"
        if not final.is_dir():
            raise UsageError(f"run '{path}' has no final/ policy (it did not finish); evaluate a finished run or its "
                             "best/ folder")
        path = final
    saved = load_yaml(path.parent / "config.yaml") if path.name in ("final", "best") and \
        (path.parent / "config.yaml").is_file() else {}
    return (*whole_model(path, saved), saved)


def whole_model(policy: Path, saved: dict[str, Any]) -> tuple[str | None, str | None]:
    """A policy folder as (model, adapter). A LoRA run's ``final/`` (or ``best/``) holds the adapter alone:
    its ``final-merged/`` (``--lora.save_merged true``) is the model with the adapter merged in, taken when
    there; else the engine loads the adapter onto its base model -- the run's ``model.path`` (None: the
    default model), for a folder outside a run the base the adapter names, ``--model.path`` over either."""
    if not (policy / "adapter_config.json").is_file() or (policy / "config.json").is_file():
        return str(policy), None
    merged = policy.with_name(policy.name + "-merged")
    if (merged / "config.json").is_file():
        return str(merged), None
    if saved:
        return (saved.get("model") or {}).get("path"), str(policy)
    try:
        base = json.loads((policy / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as exc:
        raise UsageError(f"cannot read '{policy / 'adapter_config.json'}' ({exc}); give a PEFT adapter folder as "
                         "save_pretrained writes it") from exc
    return base or None, str(policy)


def run(args: argparse.Namespace, rest: list[str], console: Console) -> int:
    from ..api import offline_defaults, prepare
    from ..config.loading import load_yaml, merge, parse_overrides

    offline_defaults()
    if args.model is None and rest and not rest[0].startswith("-"):  # rlhf eval RUN_DIR, as rlhf plot RUN_DIR
        args.model = rest.pop(0)
    folder, adapter, saved = model_and_config(args.model)
    raw = merge(without_sync(saved), load_yaml(args.config) if args.config else {})
    # asking for an evaluation turns it on: a run trained with --eval.enabled false keeps its held-out data
    raw = merge(merge(raw, parse_overrides(rest)), {"eval": {"enabled": True}})
    if folder is not None:  # an adapter's base gives way to --model.path
        raw = merge({"model": {"path": folder}}, raw) if adapter else merge(raw, {"model": {"path": folder}})
    if adapter and not saved and not (raw.get("model") or {}).get("path"):
        raise UsageError(f"LoRA adapter '{adapter}' names no base model (adapter_config.json has no "
                         "base_model_name_or_path); give the base model's folder with --model.path FOLDER")
    if args.data:
        raw = merge(raw, {"eval": {"path": args.data}})
    config, pm, plan = prepare(raw, args.plugin)
    out = Path(args.output).expanduser()
    if not out.parent.is_dir() or out.is_dir():
        raise UsageError(f"cannot write the report to '{out}': "
                         f"{'it is a folder' if out.is_dir() else 'no such folder'}; "
                         "choose another --output")
    report = evaluate(config, pm, plan, console, adapter)
    try:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        tmp.replace(out)
    except OSError as exc:
        raise UsageError(f"cannot write the report to '{out}': {exc.strerror or exc}; choose another --output") from exc
    console.print(f"report written to {escape(str(out))}", highlight=False)
    return 0


def without_sync(saved: dict[str, Any]) -> dict[str, Any]:
    """A run's saved config less its weight sync, which no evaluation has (see :func:`reads_its_weights`): a
    local run's ``inprocess`` sync would refuse an evaluation placed on Ray, a Ray run's ``broadcast`` one
    placed locally with vLLM's engine in its own process."""
    sync = {k: v for k, v in (saved.get("sync") or {}).items() if k not in ("method", "verify")}
    return {**saved, "sync": sync} if saved else saved


def reads_its_weights(config: Any, plan: Any) -> None:
    """No learner syncs into an evaluation's engine: it reads the policy folder itself. A run's saved
    ``sync.method`` (broadcast or ipc on Ray, under which engines start empty and wait for the learner's
    weights) is dropped; an engine that would still start empty is refused in one line."""
    from .._lazy import resolve

    config.sync.method, config.sync.verify = None, False
    empty = plan.engine.starts_empty
    if empty is not None and resolve(empty)(config):
        raise UsageError(f"{plan.engine.area} '{plan.engine.name}' starts without the checkpoint's weights under this "
                         "config (--vllm.load_format dummy?) and an evaluation has no learner to sync them from; "
                         "let the engine load the model (--vllm.load_format auto)")


def evaluate(config: Any, pm: Any, plan: Any, console: Console, adapter: str | None = None) -> dict[str, Any]:
    """Place the generation and reward roles (the engine with ``adapter``, a LoRA adapter folder, loaded onto
    the model), evaluate once, return the report."""
    from transformers import AutoTokenizer

    from .._lazy import resolve
    from ..data.prompts import eval_source
    from ..environments import make_env_runner
    from ..models.tiny_model import default_model_path
    from ..protocols import PlacementContext
    from ..training.heldout import make_evaluator
    from ..training.reward_role import RewardRole
    from ..training.roles import GenerationRole
    from ..training.run import load_data
    from ..training.runlog import TaskProgress, quiet_libraries

    source = eval_source(config)
    if source is None:
        raise UsageError("no held-out prompts: give --data PATH (or --eval.path, or --eval.split to hold out part of "
                         "--data.path)")
    quiet_libraries()
    reads_its_weights(config, plan)
    model_path = config.model.path or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=config.model.trust_remote_code)
    _, held = load_data(config, plan, tokenizer)
    spec = pm.spec
    ctx = PlacementContext(config, ("generation", "reward"), workers={"generation": plan.engine_workers},
                           plugin_spec=spec, accelerated=("generation", *(("reward",) if config.reward.models else ())))
    placement = resolve(plan.placement.factory)(ctx)
    runner = None
    if adapter is not None:
        fit_lora_rank(config, adapter, plan)
    try:
        engine = placement.create_role("generation", GenerationRole, config, spec, model_path, plan.engine,
                                       plan.provider(plan.engine), adapter is not None)
        if adapter is not None:
            load_saved_adapter(engine, adapter)
        reward = placement.create_role("reward", RewardRole, config, spec, plan.rewards, plan.weights)
        runner = make_env_runner(config, pm, held.columns, tokenizer)  # --env.name: multi-turn samples
        evaluator = make_evaluator(config, pm, tokenizer, engine, reward, held, runner)
        with TaskProgress(console if config.train.progress else None, "eval", "prompts") as bar:
            metrics = evaluator(0, bar)
    finally:
        if runner is not None:
            runner.close()
        placement.shutdown()
    what = model_path + (f" with the LoRA adapter {adapter}" if adapter else "")
    console.print(f"held-out evaluation of {escape(what)} on {escape(str(source))} ({len(held)} prompts, "
                  f"{config.eval.n_samples} samples each)", highlight=False, soft_wrap=True)
    show_metrics(console, metrics)
    return {"model": model_path, **({"adapter": adapter} if adapter else {}), **describe(config, plan, source, held),
            "metrics": metrics, **({"samples": evaluator.samples} if config.eval.log_samples else {})}


def describe(config: Any, plan: Any, source: str, held: Any) -> dict[str, Any]:
    """The report's data and evaluation settings."""
    e = config.eval
    return {
        "data": source if source != "split" else f"{config.data.path} (held-out split {e.split})",
        "prompts": len(held),
        "settings": {"n_samples": e.n_samples, "temperature": e.temperature,
                     "max_new_tokens": e.max_new_tokens or config.generation.max_new_tokens,
                     "threshold": e.threshold, "reward": list(e.reward_functions) or
                     [*plan.rewards, *config.reward.models, *(["remote"] if config.reward.remote_urls else [])],
                     "seed": config.train.seed},
    }


def fit_lora_rank(config: Any, folder: str, plan: Any) -> None:
    """A vLLM engine starts for the adapter's own rank (``r`` of its adapter_config.json) where
    ``--vllm.max_lora_rank`` is lower: a bare PEFT folder carries no run config saying it. An adapter
    vLLM cannot serve (DoRA...) is refused before the engine starts."""
    adapter = json.loads((Path(folder) / "adapter_config.json").read_text())
    try:
        vllm = config.section("vllm")
    except KeyError:  # no vLLM plugin: the transformers engine loads any rank
        return
    from ..builtin_plugins.generation_vllm import ENGINE

    if plan.engine.factory is ENGINE:
        from ..engines.vllm_lora import check_adapter

        check_adapter(adapter)
    rank = adapter.get("r")
    if isinstance(rank, int) and rank > vllm.max_lora_rank:
        vllm.max_lora_rank = rank


def load_saved_adapter(engine: Any, folder: str) -> None:
    """Every engine of the generation role loads the PEFT adapter saved in ``folder``."""
    from peft.utils import load_peft_weights

    from ..sync.adapter import load_into

    config = json.loads((Path(folder) / "adapter_config.json").read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise UsageError(f"'{folder}' holds a {config['peft_type']} adapter; evaluation loads LoRA adapters only "
                         "(merge it into the model and give --model FOLDER)")
    load_into(engine, load_peft_weights(folder, device="cpu"), config)


def show_metrics(console: Console, metrics: dict[str, float]) -> None:
    from rich.table import Table

    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        table.add_row(key, f"{value:.4f}")
    console.print(table)
