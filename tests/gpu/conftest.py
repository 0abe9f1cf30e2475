"""Every test here is marked ``gpu`` and needs CUDA: on a machine without it they are skipped with
the reason, so CI (no GPU) reports them as skips. ``scripts/device_check.sh`` runs them on a lent GPU."""
from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    import os

    import torch

    skip = pytest.mark.skip(reason="needs CUDA (run by scripts/device_check.sh on a GPU machine)")
    on_cpu = os.environ.get("RLHF_GPU_TESTS_DEVICE") == "cpu"  # checking the tests themselves on a CPU
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available() and not on_cpu:
                item.add_marker(skip)


@pytest.fixture
def report(request):
    """Figures a GPU test measured, collected by the device check into its JSON (via the junit XML's
    properties): ``report("gap_bf16", 0.01)``."""
    def record(key, value):
        request.node.user_properties.append((key, value))
        print(f"[gpu-report] {request.node.name} {key}={value}")
    return record
