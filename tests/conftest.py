from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_plugins.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from rlhf_plugins.testing import tiny_model_path

    return tiny_model_path()


@pytest.fixture
def rlhf(tmp_path, monkeypatch, capsys, tiny_model):
    """Run the ``rlhf`` CLI in this process, in a temporary directory, without autoload."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLHF_DISABLE_PLUGIN_AUTOLOAD", "1")

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def clean_env(extra: dict | None = None) -> dict:
    """This process's environment without the torch.distributed variables an in-process
    DeepSpeed run leaves set (a child would try to join that world)."""
    return {**{k: v for k, v in os.environ.items() if k not in DIST_ENV}, **(extra or {})}


def run_subprocess(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600):
    full_env = clean_env(env)
    return subprocess.run(
        [sys.executable, "-m", "rlhf_plugins.cli", *args],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


def short_run(*extra: str) -> list[str]:
    """Flags for a quick training run on the default task."""
    return ["--train.steps", "3", "--train.prompts_per_step", "4", "--generation.n_samples_per_prompt", "4",
            "--train.progress", "false", *extra]


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster with 8 CPUs and 4 fake GPUs, shared by one test module."""
    ray = pytest.importorskip("ray")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def block_import(monkeypatch, module: str) -> None:
    """Make ``importlib.util.find_spec(module)`` report it missing (an uninstalled extra)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
