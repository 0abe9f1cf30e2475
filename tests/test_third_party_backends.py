"""A generation engine, a learner and a weight-sync method written from the public protocols alone
(examples/minimal_backends), pip-installed as an entry-point plugin, run locally and under Ray."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import EXAMPLES, metrics_of, run_subprocess

PACKAGE = EXAMPLES / "minimal_backends"
FLAGS = ["--generation.backend", "simple", "--learner.backend", "simple", "--sync.method", "file",
         "--train.steps", "50", "--train.progress", "false"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(PACKAGE)],
        check=True, capture_output=True, text=True,
    )
    return {"PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]),
            "RLHF_DISABLE_PLUGIN_AUTOLOAD": ""}


def test_the_package_uses_only_public_exports():
    import rlhf_plugins

    tree = ast.parse((PACKAGE / "minimal_backends" / "__init__.py").read_text())
    imported = [(node.module, [a.name for a in node.names]) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlhf_plugins")]
    assert imported and all(module == "rlhf_plugins" for module, _ in imported), imported
    assert all(name in rlhf_plugins.__all__ for _, names in imported for name in names)
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    assert {c.name for c in classes} == {"SimpleEngine", "SimpleLearner", "FileSync"}
    assert all(not c.bases for c in classes)  # nothing subclassed


def test_components_come_from_the_entry_point(installed, tmp_path):
    proc = run_subprocess("plugins", "--json", cwd=tmp_path, env=installed)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    mine = {(c["area"], c["name"]) for c in data["components"] if c["provider"] == "minimal_backends"}
    assert mine == {("generation backend", "simple"), ("learner backend", "simple"), ("weight sync method", "file")}
    assert next(p for p in data["plugins"] if p["name"] == "minimal_backends")["source"] == "entry point"


def _saved_backends(run) -> tuple[str, str, str]:
    import yaml

    saved = yaml.safe_load((run / "config.yaml").read_text())
    return saved["generation"]["backend"], saved["learner"]["backend"], saved["sync"]["method"]


@pytest.mark.integration
def test_the_third_party_backends_learn_the_default_task_and_leave_no_sync_file(installed, tmp_path):
    temp = tmp_path / "temp"
    temp.mkdir()
    proc = run_subprocess("train", *FLAGS, cwd=tmp_path, env={**installed, "TMPDIR": str(temp)}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(temp.glob("rlhf-file-sync-*"))  # each sync's file is removed after the engine read it
    (run,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    # the engine samples every rollout: the reward rises only if the file sync reaches it
    assert summary["steps"] == 50 and summary["reward_gain"] >= 0.15, summary
    assert _saved_backends(run) == ("simple", "simple", "file")


@pytest.mark.integration
def test_the_third_party_backends_keep_engine_and_learner_in_step_on_ray(installed, tmp_path):
    """Under Ray the engine and the learner are separate processes: after every update the file sync
    hands the engine the learner's weights, so the log-probs the engine sampled with are the learner's
    own (a missed sync shows as a gap from the second step on)."""
    proc = run_subprocess("train", *FLAGS, "--train.steps", "8", "--placement.strategy", "ray",
                          "--ray.local_num_gpus", "4", cwd=tmp_path, env=installed, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    rows = metrics_of(run)
    assert [r["step"] for r in rows] == list(range(8))
    assert max(r["kl"] for r in rows) > 1e-4  # the policy moved away from its reference
    assert all(r["mismatch/abs_log_ratio"] < 1e-4 for r in rows), [r["mismatch/abs_log_ratio"] for r in rows]
    assert _saved_backends(run) == ("simple", "simple", "file")
