"""Fixtures shared by every test module (plain helpers live in ``tests/helpers.py``)."""
from __future__ import annotations

import os

import pytest

from rlhf_plugins.cli import main

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


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster with 8 CPUs and 4 fake GPUs on 127.0.0.1, shared by one test module."""
    ray = pytest.importorskip("ray")
    from tests.helpers import start_local_ray

    if ray.is_initialized():
        ray.shutdown()
    start_local_ray()
    yield ray
    ray.shutdown()
