"""``--sync.method ipc`` on CPU: the shared-memory buffers reach the engine and leave nothing behind."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from rlhf_plugins.sync.ipc import open_handle, remove_orphans, shared_cpu_buffer, shared_dir
from tests.helpers import metrics_of, short_run, the_run


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _left_since(start: float, wait: float = 30.0) -> list[str]:
    """Buffer files made since ``start`` that are still there after ``wait`` seconds (a sync running
    in another test unlinks its own within the sync)."""
    deadline = time.time() + wait
    while True:
        left = [p.name for p in shared_dir().glob("rlhf-ipc-*-*") if _mtime(p) >= start]
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


def _mtime(path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def test_a_colocated_ipc_run_keeps_parity_and_leaves_no_buffer_file(local_ray, rlhf):
    start = time.time() - 1
    code, _, err = rlhf("train", "--placement.strategy", "ray", "--ray.local_num_gpus", "4", "--ray.colocate", "all",
                        "--sync.method", "ipc", "--sync.verify", "true", *short_run())
    assert code == 0, err
    rows = metrics_of(the_run())
    assert len(rows) == 3 and all(r["time/sync"] > 0 for r in rows), rows  # --sync.verify checked each one
    assert _left_since(start) == []


def test_a_buffer_file_is_gone_once_mapped_and_the_mapping_lives_on():
    tensor, handle, path = shared_cpu_buffer(8, __import__("torch").bfloat16)
    other = open_handle(handle)
    path.unlink()
    tensor.fill_(3.5)
    assert not path.exists()
    assert other.tolist() == [3.5] * 8 and str(other.dtype) == "torch.bfloat16"


def test_a_sender_removes_the_files_of_dead_senders_only(tmp_path):
    dead = tmp_path / f"rlhf-ipc-{_dead_pid()}-abc"
    alive = tmp_path / f"rlhf-ipc-{os.getpid()}-abc"
    unrelated = tmp_path / "torch_1_2_3"
    for path in (dead, alive, unrelated):
        path.write_bytes(b"x")
    assert remove_orphans(tmp_path) == [dead]
    assert not dead.exists() and alive.exists() and unrelated.exists()


def test_new_engines_get_new_buffers_and_every_file_is_unlinked_after_the_sync(tiny_model, monkeypatch):
    """The sender's two cases: the first sync to some engines (the engine maps the files and aliases
    its weights to them) and a later one to restarted engines (``fresh``: new files, since the old
    ones are gone). After each, the engine holds the sent weights and no file of the sender is left."""
    import torch

    from rlhf_plugins.api import prepare
    from rlhf_plugins.engines.transformers_engine import TransformersEngine
    from rlhf_plugins.sync import ipc
    from rlhf_plugins.testing import backend_context
    from rlhf_plugins.training.roles import LocalEndpoint, Role

    config, pm, _ = prepare({}, autoload=False)
    role = Role()
    role.backend = TransformersEngine(backend_context(config, "generation", tiny_model, pm))
    made = []
    monkeypatch.setattr(ipc, "shared_cpu_buffer", lambda *a: made.append(shared_cpu_buffer(*a)) or made[-1])
    sender = ipc.IPCSender()
    for fresh, shift in ((True, 0.25), (False, 0.5), (True, 1.0)):
        weights = [(name, p.detach() + shift) for name, p in role.backend.model.named_parameters()]
        sender.send(iter(weights), [LocalEndpoint(role)], 1 << 20, fresh)
        got = dict(role.backend.model.named_parameters())
        assert all(torch.equal(got[name], value) for name, value in weights)
        assert list(shared_dir().glob(f"rlhf-ipc-{os.getpid()}-*")) == []
    paths = [path for _, _, path in made]
    assert len(paths) == 2 * len(sender.buffers) and len(set(paths)) == len(paths)  # the middle sync reused them


@pytest.mark.parametrize("shape", ["tiny", "reduced-qwen-tied"])
def test_an_engine_under_ipc_starts_empty_and_its_weights_become_the_shared_buffers(tiny_model, shape):
    """Under IPC the transformers engine never reads the checkpoint: its parameters are empty until the
    first sync, which points them at the shared buffers (no copy), a tied head with its embedding;
    generating before that sync is refused in one line."""
    import torch

    from rlhf_plugins.api import prepare
    from rlhf_plugins.engines.transformers_engine import TransformersEngine
    from rlhf_plugins.protocols import SamplingParams
    from rlhf_plugins.sync import ipc
    from rlhf_plugins.testing import backend_context, reduced_model_path
    from rlhf_plugins.training.roles import LocalEndpoint, Role

    model = tiny_model if shape == "tiny" else reduced_model_path()
    config, pm, _ = prepare({}, autoload=False)
    config.sync.method = "ipc"
    engine = TransformersEngine(backend_context(config, "generation", model, pm))
    assert all(p.is_meta for p in engine.model.parameters())
    assert all(not b.is_meta for b in engine.model.buffers())
    with pytest.raises(RuntimeError, match="started without weights and no sync has filled"):
        engine.generate([[1, 2, 3]], SamplingParams(n=1, max_new_tokens=2, seed=0))
    from transformers import AutoModelForCausalLM

    whole = AutoModelForCausalLM.from_pretrained(model)
    role = Role()
    role.backend = engine
    sender = ipc.IPCSender()
    sender.send(iter(list(whole.named_parameters())), [LocalEndpoint(role)], 1 << 20, True)
    from rlhf_plugins.protocols import _WORKER_STATE

    mapped = [flat for _, flat, _ in _WORKER_STATE[engine][ipc.KEY].values()]  # the engine's own mappings
    spans = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in mapped]
    for name, param in engine.model.named_parameters():
        assert not param.is_meta and torch.equal(param, dict(whole.named_parameters())[name]), name
        assert any(lo <= param.data_ptr() < hi for lo, hi in spans), f"{name} was copied, not aliased"
    tied = shape != "tiny"
    assert whole.config.tie_word_embeddings == tied
    assert (engine.model.get_output_embeddings().weight is engine.model.get_input_embeddings().weight) == tied
    greedy = SamplingParams(n=1, max_new_tokens=4, temperature=0.0, seed=0)
    reference = TransformersEngine(backend_context(prepare({}, autoload=False)[0], "generation", model, pm))
    assert engine.generate([[1, 2, 3]], greedy).completion_ids == reference.generate([[1, 2, 3]], greedy).completion_ids


def test_a_resumed_run_syncs_an_empty_engine_once_with_the_restored_policy(local_ray, rlhf, monkeypatch):
    """An engine that starts without weights gets them before the first generation: at set-up in a new
    run (step -1), from the loaded checkpoint in a resumed one -- once, not first the initial weights
    and then the checkpoint's."""
    from rlhf_plugins.sync.ipc import IPCSync

    calls: list[int] = []
    real = IPCSync.sync
    monkeypatch.setattr(IPCSync, "sync", lambda self, actor, engine, step: calls.append(step) or real(self, actor, engine, step))
    layout = ["--placement.strategy", "ray", "--ray.local_num_gpus", "4", "--ray.colocate", "all", "--sync.method", "ipc"]
    code, _, err = rlhf("train", *layout, *short_run("--train.steps", "2", "--train.save_every", "2"))
    assert code == 0, err
    assert calls[0] == -1 and len(calls) == 3, calls  # set-up, then after each update
    calls.clear()
    code, out, err = rlhf("train", "--resume", str(the_run()), "--train.steps", "3")
    assert code == 0 and "resumed from" in out, err
    assert calls[0] == 2 and -1 not in calls and len(calls) == 2, calls  # the checkpoint's weights, then step 3's
