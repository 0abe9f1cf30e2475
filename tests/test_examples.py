"""The example third-party plugin, pip-installed for real and picked by entry-point name."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers import EXAMPLES, metrics_of, run_subprocess, short_run


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    """pip-install examples/my_reward into its own folder (the test venv stays clean)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(EXAMPLES / "my_reward")],
        check=True, capture_output=True, text=True,
    )
    return {"PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]),
            "RLHF_DISABLE_PLUGIN_AUTOLOAD": ""}


def test_example_plugin_is_listed_as_an_entry_point(installed_example, tmp_path):
    proc = run_subprocess("plugins", "--json", cwd=tmp_path, env=installed_example)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    mine = [p for p in data["plugins"] if p["name"] == "my_reward"]
    assert mine and mine[0]["source"] == "entry point" and mine[0]["version"] == "0.1.0"
    assert mine[0]["hooks"] == ["rlhf_add_options", "rlhf_reward_functions"]
    assert {"area": "reward function", "name": "closeness", "provider": "my_reward"}.items() <= next(
        c for c in data["components"] if c["name"] == "closeness").items()


def test_train_picks_the_example_by_entry_point_name(installed_example, tmp_path):
    env = {**installed_example, "RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = run_subprocess("train", "--plugin", "my_reward", "--closeness.scale", "5", *short_run(), cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    (run,) = (tmp_path / "runs").iterdir()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["reward"]["functions"] == ["closeness"]
    assert saved["closeness"] == {"scale": 5.0}
    assert "my_reward" in saved["plugins"]
    rewards = [r["reward/mean"] for r in metrics_of(run)]
    assert len(rewards) == 3 and all(0.0 <= r <= 1.0 for r in rewards)


def test_blocking_the_example(installed_example, tmp_path):
    proc = run_subprocess("plugins", "--json", "--plugin", "no:my_reward", cwd=tmp_path, env=installed_example)
    assert proc.returncode == 0
    assert "my_reward" not in {p["name"] for p in json.loads(proc.stdout)["plugins"]}


def test_example_reward_numbers(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("my_reward", EXAMPLES / "my_reward" / "my_reward" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "my_reward", module)
    spec.loader.exec_module(module)
    closeness = module.closeness
    assert closeness([""] * 4, ["7", "5", "x", "20"], ["7", "7", "7", "7"], scale=10.0) == [1.0, 0.8, 0.0, 0.0]
