"""Experiment trackers (Weights & Biases offline, MLflow's local store) as builtin observer plugins:
they receive exactly what metrics.jsonl holds, and a resumed run continues the same tracker run."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from rlhf_plugins.tables import eval_table_of
from tests.helpers import block_import, eval_rows_of, eval_samples_of, metrics_of, samples_of, short_run, with_eval


def step_table(run: Path, step: int) -> tuple[list[str], list[list[Any]]]:
    """The table a tracker should hold for a step: samples.jsonl's rows of it, as columns and data."""
    from rlhf_plugins.tables import table_of

    return table_of([r for r in samples_of(run) if r["step"] == step])


def wandb_records(run_dir: Path) -> list:
    """Every record of every offline W&B run under ``run_dir``, read from wandb's own record files
    (LevelDB-style log blocks of ``wandb.proto`` Record messages)."""
    from wandb.proto import wandb_internal_pb2 as pb

    records = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, block, pending, payloads = path.read_bytes(), 7, 32768, b"", []
        while pos + 7 <= len(data):
            left = block - pos % block
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
            if left < 7 or (kind == 0 and length == 0):
                pos += left
                continue
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind in (1, 4):
                payloads.append(pending)
        for payload in payloads:
            records.append(pb.Record())
            records[-1].ParseFromString(payload)
    return records


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history rows of every offline W&B run under ``run_dir`` (a table: its JSON reference)."""
    return [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            for record in wandb_records(run_dir) if record.WhichOneof("record_type") == "history"]


def wandb_tables(run_dir: Path, key: str) -> dict[int, dict[str, Any]]:
    """Each step's table logged under ``key``, as W&B wrote its file ({"columns", "data"})."""
    tables = {}
    for row in wandb_history(run_dir):
        if f"{key}/path" in row:  # the table's reference, its fields as nested keys
            (path,) = run_dir.glob(f"wandb/offline-run-*/files/{row[f'{key}/path']}")
            tables[int(row["step"])] = json.loads(path.read_text())
    return tables


def test_wandb_offline_receives_every_step_and_evaluation_and_resumes_its_run(rlhf):
    pytest.importorskip("wandb")
    import sys

    exit_before = sys.exit
    flags = ("--log.wandb", "true", "--log.wandb_mode", "offline", "--train.save_every", "1",
             "--train.log_samples_every", "2", "--eval.log_samples", "true")
    code, _, err = rlhf("train", *with_eval("--train.steps", "2", "--train.run_name", "w", *flags))
    assert code == 0, err
    code, _, err = rlhf("train", "--resume", "runs/w", "--train.steps", "3")
    assert code == 0, err
    run = Path("runs/w")
    history = wandb_history(run)
    steps = [(int(r["step"]), r["reward/mean"], r["loss/total"]) for r in history if "reward/mean" in r]
    assert steps == [(r["step"], pytest.approx(r["reward/mean"]), pytest.approx(r["loss/total"]))
                     for r in metrics_of(run)]
    evals = [(int(r["step"]), r["eval/pass@1"]) for r in history if "eval/pass@1" in r]
    assert evals == [(r["step"], pytest.approx(r["eval/pass@1"])) for r in eval_rows_of(run)]
    assert [s for s, _ in evals] == [0, 2, 3]
    tables = wandb_tables(run, "samples")  # the samples of steps 0 and 2 (after the resume), as samples.jsonl's
    assert sorted(tables) == [0, 2]
    for step, table in tables.items():
        columns, data = step_table(run, step)
        assert table["columns"] == columns and table["data"] == data and len(data) == 16
    held = wandb_tables(run, "eval_samples")  # each evaluation's records, as eval_samples.jsonl's
    assert sorted(held) == [0, 2, 3]
    for step, table in held.items():
        columns, data = eval_table_of([r for r in eval_samples_of(run) if r["step"] == step])
        assert table["columns"] == columns and table["data"] == data and len(data) == 20
    ids = {p.name.rsplit("-", 1)[1] for p in run.glob("wandb/offline-run-*")}
    assert len(list(run.glob("wandb/offline-run-*"))) == 2 and len(ids) == 1  # one W&B run, continued
    assert sys.exit is exit_before  # wandb's exit hook does not outlive the run


def test_wandb_run_files_are_complete_when_training_returns_even_if_wandbs_service_lags(rlhf, monkeypatch):
    """wandb's service writes an offline run file in 32 KB blocks and its last block when it closes
    the run, after ``run.finish()`` has returned (finish is announced to the service, not awaited).
    The service is held stopped across that announcement for two seconds: the history read right
    after training returns is whole only if training waited for the service."""
    pytest.importorskip("wandb")
    import threading

    import psutil
    from wandb.sdk.lib.service.service_connection import ServiceConnection

    announce, held = ServiceConnection.inform_finish, []

    def lagging(self, run_id: str) -> None:
        held.extend(p for p in psutil.Process().children(recursive=True) if p.name().startswith("wandb-core"))
        for process in held:
            process.suspend()
        threading.Timer(2.0, lambda: [p.resume() for p in held]).start()
        announce(self, run_id)

    monkeypatch.setattr(ServiceConnection, "inform_finish", lagging)
    flags = ("--log.wandb", "true", "--log.wandb_mode", "offline", "--train.run_name", "w", "--log.wandb_group", "g")
    code, _, err = rlhf("train", *short_run(), *flags)
    assert code == 0, err
    assert held  # the service was there and was held back
    history = wandb_history(Path("runs/w"))
    assert [int(r["step"]) for r in history if "reward/mean" in r] == [r["step"] for r in metrics_of(Path("runs/w"))]
    runs = [r.run for r in wandb_records(Path("runs/w")) if r.WhichOneof("record_type") == "run"]
    assert runs and {(r.display_name, r.run_group) for r in runs} == {("w", "g")}  # OpenRLHF's --wandb_group


def test_mlflow_local_store_receives_metrics_params_and_resumes_its_run(rlhf):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    flags = ("--log.mlflow", "true", "--train.save_every", "1", "--train.log_samples_every", "2",
             "--eval.log_samples", "true")
    code, _, err = rlhf("train", *with_eval("--train.steps", "2", "--train.run_name", "m", *flags))
    assert code == 0, err
    code, _, err = rlhf("train", "--resume", "runs/m", "--train.steps", "3")
    assert code == 0, err
    run = Path("runs/m")
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "rlhf-plugins"]
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.status == "FINISHED" and found.info.run_name == "m"
    assert found.data.params["algo.advantage.estimator"] == "group_norm" and found.data.params["train.steps"] == "2"
    rewards = client.get_metric_history(found.info.run_id, "reward.mean")
    assert [(m.step, m.value) for m in sorted(rewards, key=lambda m: m.step)] == \
        [(r["step"], r["reward/mean"]) for r in metrics_of(run)]
    evals = client.get_metric_history(found.info.run_id, "eval.pass_at_1")
    assert sorted(m.step for m in evals) == [r["step"] for r in eval_rows_of(run)] == [0, 2, 3]
    artifacts = Path(client.download_artifacts(found.info.run_id, "samples"))
    assert sorted(p.name for p in artifacts.iterdir()) == ["step-000000.json", "step-000002.json"]
    for step in (0, 2):
        table = json.loads((artifacts / f"step-{step:06d}.json").read_text())
        columns, data = step_table(run, step)
        assert table["columns"] == columns and len(table["data"]) == len(data) == 16
        for got, want in zip(table["data"], data):  # MLflow writes numbers to 10 digits (pandas' to_json)
            assert [x for x in got if isinstance(x, str)] == [x for x in want if isinstance(x, str)]
            numbers = [x for x in want if not isinstance(x, str)]
            assert [x for x in got if not isinstance(x, str)] == pytest.approx(numbers, rel=1e-9, abs=1e-10)
    held = Path(client.download_artifacts(found.info.run_id, "eval_samples"))
    assert sorted(p.name for p in held.iterdir()) == [f"step-{s:06d}.json" for s in (0, 2, 3)]
    table = json.loads((held / "step-000003.json").read_text())
    columns, data = eval_table_of([r for r in eval_samples_of(run) if r["step"] == 3])
    assert table["columns"] == columns and table["data"] == data and len(data) == 20


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_is_one_line(rlhf, monkeypatch, package):
    block_import(monkeypatch, package)
    code, _, err = rlhf("train", f"--log.{package}", "true", *short_run())
    assert code == 2
    assert err.strip() == (f"rlhf: error: log.{package} needs the {package} package; install it with: "
                           f"pip install 'rlhf-plugins[{package}]'")
