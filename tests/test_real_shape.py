"""A real vocabulary through every execution path, in CI: a random-weight Qwen2.5 shape reduced to
two narrow layers (151,936 tokens, tied embeddings, grouped-query attention) trains two steps locally
with chunked logits, with vLLM, and in the seeds' production layout (Ray, DeepSpeed ZeRO-3 over two
ranks, a reference, vLLM, broadcast sync). The full-size runs are bench/scale.py's."""
from __future__ import annotations

import pytest

from rlhf_plugins.models.memory import ModelShape
from rlhf_plugins.testing import reduced_model_path
from tests.helpers import metrics_of, the_run

pytest.importorskip("vllm")

STEPS = ["--train.steps", "2", "--train.prompts_per_step", "4", "--generation.n_samples_per_prompt", "4",
         "--generation.max_new_tokens", "6", "--data.max_prompt_tokens", "32", "--eval.enabled", "false",
         "--train.progress", "false"]


@pytest.fixture(scope="module")
def reduced() -> str:
    path = reduced_model_path()
    shape = ModelShape.of_folder(path)
    assert shape.vocab == 151936 and shape.tied and shape.kv_dim < shape.q_dim
    return path


def _ran(rows: list[dict], roles: tuple[str, ...]) -> None:
    assert len(rows) == 2
    for row in rows:
        assert all(row[f"memory/{r}_rss_gb"] > 0 for r in roles)
        assert row["kl"] == row["kl"] and row["loss/policy"] == row["loss/policy"]  # finite, not NaN


def test_local_path_with_chunked_logits(rlhf, reduced):
    """Eight tokens of logits per chunk: the reference and the learner go through the chunked head."""
    code, out, err = rlhf("train", "--model.path", reduced, "--learner.logits_memory_mb", "14", *STEPS)
    assert code == 0, err
    assert "logits chunk 14 MB" in out
    _ran(metrics_of(the_run()), ("generation", "actor", "reference"))


@pytest.mark.integration
def test_local_path_with_vllm(rlhf, reduced):
    code, out, err = rlhf("train", "--model.path", reduced, "--generation.backend", "vllm", "--sync.verify", "true",
                          *STEPS)
    assert code == 0, err
    assert "KV cache (reserved)" in out  # sized from the run, not from the machine's free memory
    _ran(metrics_of(the_run()), ("generation", "actor", "reference"))


@pytest.mark.integration
def test_the_seeds_production_layout(local_ray, rlhf, reduced):
    """Ray + DeepSpeed ZeRO-3 x 2 ranks + reference + vLLM with broadcast sync: each role in its own
    process, each reporting its peak, the engine matching the learner after every sync."""
    code, out, err = rlhf("train", "--model.path", reduced, "--placement.strategy", "ray", "--learner.backend",
                          "deepspeed", "--deepspeed.zero_stage", "3", "--ray.actor_workers", "2",
                          "--generation.backend", "vllm", "--sync.verify", "true", *STEPS)
    assert code == 0, err
    assert "[actor x2] actor" in out
    rows = metrics_of(the_run())
    _ran(rows, ("generation", "actor", "reference", "reward"))
    assert rows[-1]["memory/generation_rss_gb"] != rows[-1]["memory/actor_rss_gb"]  # separate processes
