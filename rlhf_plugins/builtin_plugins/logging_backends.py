"""Experiment trackers as observers: Weights & Biases and MLflow.

``--log.wandb true`` / ``--log.mlflow true`` send every step's metrics, every held-out
evaluation and the run's config to the tracker, through the lifecycle hooks any plugin can
implement (``metrics.jsonl`` and TensorBoard are always written). The tracker's run id is plugin
state, so ``rlhf train --resume`` continues the same tracker run. A third-party tracker is a
plugin with the same four hooks (``rlhf_before_train``, ``rlhf_after_step``, ``rlhf_after_eval``,
``rlhf_after_train``) and one entry point.
"""
from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._markers import hookimpl
from ..errors import ConfigError


@dataclass
class LogOptions:
    #: send metrics to Weights & Biases (pip install wandb; --log.wandb_mode offline needs no account)
    wandb: bool = False
    #: W&B project (empty: rlhf-plugins)
    wandb_project: str | None = None
    #: W&B entity (team or user; empty: your default)
    wandb_entity: str | None = None
    #: W&B run group (empty: none, or WANDB_RUN_GROUP; OpenRLHF's --wandb_group)
    wandb_group: str | None = None
    #: online | offline | disabled (empty: wandb's default, or WANDB_MODE)
    wandb_mode: str | None = None
    #: send metrics to MLflow (pip install mlflow-skinny)
    mlflow: bool = False
    #: MLflow tracking URI (empty: MLFLOW_TRACKING_URI, else a local store in <run>/mlruns)
    mlflow_tracking_uri: str | None = None
    #: MLflow experiment name
    mlflow_experiment: str = "rlhf-plugins"


class Tracker:
    """One experiment tracker: start (or continue) a run, log, finish."""

    package = ""
    extra = ""

    def __init__(self) -> None:
        self.run_id: str | None = None

    def start(self, config: Any, run_dir: Path) -> None: ...
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def samples(self, columns: list[str], data: list[list[Any]], step: int, key: str = "samples") -> None: ...
    def finish(self, failed: bool) -> None: ...


class WandbTracker(Tracker):
    package, extra = "wandb", "wandb"

    def start(self, config: Any, run_dir: Path) -> None:
        import sys

        import wandb

        self.sys_exit = sys.exit  # wandb hooks sys.exit for the run's lifetime; given back in finish()
        o = config.section("log")
        self.run = wandb.init(project=o.wandb_project or "rlhf-plugins", entity=o.wandb_entity, name=run_dir.name,
                              group=o.wandb_group, dir=str(run_dir), config=config.to_dict(), mode=o.wandb_mode,
                              id=self.run_id, resume="allow" if self.run_id else None, reinit="finish_previous")
        self.run_id = self.run.id
        # our step is a metric of its own: W&B's internal step must only grow, and an evaluation
        # and the training step of the same policy share a step (also across a resume)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, "step": step})

    def samples(self, columns: list[str], data: list[list[Any]], step: int, key: str = "samples") -> None:
        import wandb

        self.run.log({key: wandb.Table(columns=columns, data=data), "step": step})

    def finish(self, failed: bool) -> None:
        import sys

        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # finish() only announces the end to wandb's service, which writes the run's offline file in
        # 32 KB blocks and the last block when it closes the run, later: shutting the service down
        # waits for that, so the run's files are complete when training returns (also in-process).
        # Only when no other W&B run lives in this process (our start finished any earlier one).
        if wandb.run is None:
            wandb.teardown(exit_code=1 if failed else 0)
        sys.exit = self.sys_exit


#: MLflow metric names allow letters, digits, ``_ - . /`` and spaces
_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-./ ]")


def metric_name(name: str, file_store: bool = False) -> str:
    """``eval/pass@1`` -> ``eval/pass_at_1`` (MLflow's allowed characters). A file store keeps each
    metric in a file named after it, so ``kl`` and ``kl/coef`` cannot both exist there: it gets
    ``eval.pass_at_1``."""
    name = _MLFLOW_BAD.sub("_", name.replace("@", "_at_"))
    return name.replace("/", ".") if file_store else name


class MlflowTracker(Tracker):
    package, extra = "mlflow", "mlflow"

    def start(self, config: Any, run_dir: Path) -> None:
        import os

        import mlflow

        o = config.section("log")
        uri = o.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a store of its own in the run directory: MLflow's file store, which it keeps working
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.file_store = uri.startswith("file:") or "://" not in uri
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(o.mlflow_experiment)
        self.run = mlflow.start_run(run_id=self.run_id, run_name=None if self.run_id else run_dir.name)
        self.run_id = self.run.info.run_id
        if not self.run.data.params:  # a continued run keeps the parameters it started with
            mlflow.log_params({k: str(v)[:500] for k, v in _flatten(config.to_dict()).items()})

    def log(self, metrics: dict[str, float], step: int) -> None:
        import mlflow

        mlflow.log_metrics({metric_name(k, self.file_store): v for k, v in metrics.items()}, step=step)

    def samples(self, columns: list[str], data: list[list[Any]], step: int, key: str = "samples") -> None:
        import mlflow

        mlflow.log_table({c: [row[i] for row in data] for i, c in enumerate(columns)},
                         artifact_file=f"{key}/step-{step:06d}.json")

    def finish(self, failed: bool) -> None:
        import mlflow

        mlflow.end_run("FAILED" if failed else "FINISHED")


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


TRACKERS: dict[str, type[Tracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker}
#: the trackers of the run in this process, by name
_active: dict[str, Tracker] = {}
_resumed: dict[str, str] = {}


def _finite(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


@hookimpl
def rlhf_add_options(options: Any) -> None:
    options.add_section("log", LogOptions)


@hookimpl
def rlhf_configure(config: Any) -> None:
    o = config.section("log")
    for name, cls in TRACKERS.items():
        if getattr(o, name) and importlib.util.find_spec(cls.package) is None:
            raise ConfigError(f"log.{name} needs the {cls.package} package; install it with: "
                              f"pip install 'rlhf-plugins[{cls.extra}]'")
    if o.wandb_mode not in (None, "online", "offline", "disabled"):
        raise ConfigError(f"log.wandb_mode must be online, offline or disabled; got '{o.wandb_mode}'")


@hookimpl
def rlhf_before_train(config: Any, run_dir: Path) -> None:
    _active.clear()
    o = config.section("log")
    for name, cls in TRACKERS.items():
        if getattr(o, name):
            tracker = cls()
            tracker.run_id = _resumed.get(name)
            tracker.start(config, run_dir)
            _active[name] = tracker
    _resumed.clear()


@hookimpl
def rlhf_after_step(step: int, metrics: Mapping[str, float]) -> None:
    for tracker in _active.values():
        tracker.log(_finite(metrics), step)


@hookimpl
def rlhf_after_samples(step: int, samples: list[dict[str, Any]]) -> None:
    from ..tables import table_of

    columns, data = table_of(samples)
    for tracker in _active.values():
        tracker.samples(columns, data, step)


@hookimpl
def rlhf_after_eval(step: int, metrics: Mapping[str, float], samples: list[dict[str, Any]]) -> None:
    from ..tables import eval_table_of

    table = eval_table_of(samples) if samples else None  # --eval.log_samples: the records, as eval_samples
    for tracker in _active.values():
        tracker.log(_finite(metrics), step)
        if table is not None:
            tracker.samples(*table, step, key="eval_samples")


@hookimpl
def rlhf_after_train(run_dir: Path, metrics: Mapping[str, Any]) -> None:
    _finish(failed=False)


@hookimpl
def rlhf_on_error(step: int | None, error: BaseException) -> None:
    _finish(failed=True)


def _finish(failed: bool) -> None:
    for tracker in _active.values():
        tracker.finish(failed)
    _active.clear()


@hookimpl
def rlhf_state_dict() -> Mapping[str, Any] | None:
    ids = {name: t.run_id for name, t in _active.items() if t.run_id}
    return {"run_ids": ids} if ids else None


@hookimpl
def rlhf_load_state_dict(state: Mapping[str, Any]) -> None:
    _resumed.update(state.get("run_ids", {}))
