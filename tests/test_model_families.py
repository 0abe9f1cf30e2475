"""Decoder architectures beyond the ones the project is built around, from their public configs: the
fields that make each one different kept, the widths and depths reduced, the real vocabulary kept.
Gemma 2 (soft-capped attention and logits, sliding-window layers), Gemma 3 (q/k norms, sliding and full
layers with their own RoPE), Phi-3 (fused qkv and gate-up projections), Mistral, Granite (scaled
embeddings, residuals, attention and logits), SmolLM3 (layers without RoPE), Seed-OSS (dropout in its
config, turned off in training by --learner.disable_dropout), GLM-4 (partial RoPE), DeepSeek-V3 (latent
attention, routed and shared experts). Each trains a step with the
transformers engine on the CPU: the log-probs the engine samples with (decoding shared prefixes once
where the attention is plain) are those of the model's own forward, one unpadded sample at a time, and
the learner's (packed micro batches, its head applied in chunks), to float32 rounding; the update moves the weights by a finite step. Queries and keys are drawn
at a trained model's spread, so that attention is far from uniform: a wrong softmax scale or mask shows."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import ARCHITECTURES, family_model_path, in_process_trainer, sampling_logprobs, speedups_supported

#: a TRL-style reward that tells samples apart, so the update is not zero (by token ids: most of these
#: models' ids are past the embedded tokenizer's, whose text is empty)
REWARD = '''
def mean_token_id(prompts, completions, completion_ids, **kwargs):
    return [sum(ids) / len(ids) / 100000 for ids in completion_ids]
'''


def _prompts(folder: Path) -> Path:
    """Sums of 12 to 28 digits (past SHARED_PREFIX_MIN_PROMPT tokens: the engine decodes shared prefixes)."""
    path = folder / "sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": "+".join("123456789"[: 3 + i % 5] * 4) + "="}) + "\n"
                            for i in range(8)))
    return path


def _engine_matches_the_models_own_forward(folder: str, engine: Any, prompts: Path) -> None:
    """The engine's samples of two prompts, 4 each, carry the log-probs the model's own forward (a fresh
    transformers model, one unpadded sample at a time) gives them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_plugins import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in prompts.read_text().splitlines()[:2]]
    samples = engine.generate(ids, SamplingParams(n=4, max_new_tokens=8, temperature=0.9, seed=3))
    own = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for i, (completion, logprobs) in enumerate(zip(samples.completion_ids, samples.logprobs)):
        want, _ = sampling_logprobs(own, ids[i // 4], completion, 0.9)
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_each_architecture_trains_a_step_sampling_the_log_probs_the_learner_computes(name, tmp_path, monkeypatch):
    from rlhf_plugins.learners import base
    from rlhf_plugins.models import forward, kv_cache, packing
    from rlhf_plugins.models.logits import BYTES_PER_LOGIT

    monkeypatch.chdir(tmp_path)
    reward = tmp_path / "mean_token_id.py"
    reward.write_text(REWARD)
    vocab = ARCHITECTURES[name][1]["vocab_size"]
    chunks, cascades, packed = [], [], []
    head_token_stats, cascade, lay_out = forward.head_token_stats, kv_cache.cascade_attention, packing.lay_out
    monkeypatch.setattr(forward, "head_token_stats", lambda *a: chunks.append(a[5]) or head_token_stats(*a))
    monkeypatch.setattr(kv_cache, "cascade_attention", lambda *a: cascades.append(1) or cascade(*a))
    for where, module in (("log-probs", packing), ("update", base)):
        monkeypatch.setattr(module, "lay_out", lambda *a, where=where, **k: packed.append(where) or lay_out(*a, **k))
    prompts, folder = _prompts(tmp_path), family_model_path(name)
    raw = {"plugins": [str(reward)], "data": {"path": str(prompts), "apply_chat_template": False},
           "train": {"prompts_per_step": 2, "steps": 1},
           "generation": {"n_samples_per_prompt": 4, "max_new_tokens": 8, "temperature": 1.0},
           # a few tokens a chunk of logits, and packed micro batches
           "learner": {"logits_memory_mb": 4 * vocab * BYTES_PER_LOGIT / 2**20, "max_tokens_per_micro_batch": 160}}
    t = in_process_trainer(folder, raw)
    try:
        _engine_matches_the_models_own_forward(folder, t.engine, prompts)
        before = [p.detach().clone() for p in t.actor.learner.model.parameters()]
        metrics = t.step(0)
        after = list(t.actor.learner.model.parameters())
    finally:
        t.shutdown()
    assert metrics["mismatch/abs_log_ratio"] < 2e-6, metrics["mismatch/abs_log_ratio"]  # the learner's, the engine's
    assert metrics["reward/std"] > 0 and torch.isfinite(torch.tensor(metrics["loss/total"]))
    assert 0 < metrics["grad_norm"] < float("inf")
    moved = max((a - b).abs().max().item() for a, b in zip(after, before))
    assert 0 < moved < 1
    assert chunks and max(chunks) <= 4  # Granite's scaled logits too (through its scaled hidden states)
    assert set(packed) == {"log-probs", "update"}  # the learner's micro batches were packed rows, both passes
    # plain attention over full-attention layers: the engine reads each prompt's keys once for its samples
    plain = ("glm4", "granite", "mistral", "phi3", "seed_oss", "smollm3")
    assert bool(cascades) == (name in plain and speedups_supported())
