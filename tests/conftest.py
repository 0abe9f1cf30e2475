"""Fixtures shared by every test module (plain helpers live in ``tests/helpers.py``)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from rlhf_plugins.cli import main

#: the modules that take longest (minutes of Ray / vLLM / DeepSpeed runs in subprocesses; the order measured
#: under the README's command, 2026-12-06), collected first: under `pytest -n 3 --dist loadfile
#: --no-loadscope-reorder` the workers start on them and finish together instead of one worker running a
#: long module alone at the end
LONGEST_FIRST = ("test_vllm", "test_faults_and_resume_at_scale", "test_ray_training", "test_real_shape", "test_fsdp",
                 "test_trl_peft", "test_ray", "test_memory", "test_third_party_backends", "test_checkpoints",
                 "test_pipeline", "test_modeling", "test_ray_multinode", "test_reference_sync", "test_environments",
                 "test_ipc_sync", "test_stages", "test_compile", "test_evaluation", "test_trl_environments",
                 "test_logits_chunks", "test_remote_reward", "test_muon", "test_ema", "test_train",
                 "test_rough_edges", "test_algo_runs", "test_model_families", "test_deepspeed_learner")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).stem, len(LONGEST_FIRST)))  # stable for the rest


if os.environ.get("PYTEST_XDIST_WORKER"):
    # three workers on two cores (a worker often waits on a subprocess, a Ray actor or a server): one
    # intra-op thread each, in the worker and the runs it starts (two workers' 2-thread torch pools on
    # 2 cores made a 16 s test take 145 s when they met)
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def ray_workers_from_a_zygote(request):
    """When this session runs integration tests (Ray clusters among them) on Linux, the Ray workers they
    start are forked from a process that imported torch and transformers once (:mod:`tests.ray_zygote`),
    unless ``RLHF_TEST_FRESH_RUNS=1``."""
    wanted = (sys.platform.startswith("linux") and os.environ.get("RLHF_TEST_FRESH_RUNS") != "1"
              and any(item.get_closest_marker("integration") for item in request.session.items))
    if not wanted:
        yield None
        return
    from tests.ray_zygote import Zygote

    zygote = Zygote()
    yield zygote
    zygote.stop()


@pytest.fixture(scope="module", autouse=True)
def no_world_of_one_left_over():
    """A module starts without the world of one an earlier module's in-process sharded learner left (its
    process group and rank variables, :func:`rlhf_plugins.learners.sharded.rank_environment`): with LOCAL_RANK
    set, accelerate (a TRL stage's Trainer) takes the run for a distributed one and waits at barriers of that
    group -- which an earlier module's vLLM engine, ending when collected, destroys (a test process runs dozens
    of modules; a CLI run is a process of its own)."""
    import gc

    from tests.helpers import DIST_ENV

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        gc.collect()  # what ends with an earlier module's objects ends now, not inside this module's tests
    alive = dist is not None and dist.is_available() and dist.is_initialized()
    if not alive and os.environ.get("WORLD_SIZE") == "1" and os.environ.get("MASTER_ADDR") == "127.0.0.1":
        for key in DIST_ENV:
            os.environ.pop(key, None)
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
    yield


@pytest.fixture
def local_ray_fresh_workers(monkeypatch):
    """:func:`local_ray` whose workers are fresh interpreters (not forked by :mod:`tests.ray_zygote`), for a
    test of what a worker process imports; a module's running cluster is stopped for it and started again."""
    ray = pytest.importorskip("ray")
    from tests.helpers import start_local_ray
    from tests.ray_zygote import SOCKET_ENV

    was_running = ray.is_initialized()
    ray.shutdown()
    with monkeypatch.context() as m:
        m.delenv(SOCKET_ENV, raising=False)
        start_local_ray()
        yield ray
        ray.shutdown()
    if was_running:
        start_local_ray()


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
