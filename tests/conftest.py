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


def run_subprocess(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "rlhf_plugins.cli", *args],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


def short_run(*extra: str) -> list[str]:
    """Flags for a quick training run on the default task."""
    return ["--train.steps", "3", "--train.prompts_per_step", "4", "--generation.n_samples_per_prompt", "4",
            "--train.progress", "false", *extra]
