"""The DeepSpeed learner in this process (world size 1, gloo) trains the model its engine wraps as the torch
learner trains it, for the model options read from the model's config: a soft cap on the logits (Gemma 2,
its head applied in chunks), a mixture of experts' load-balancing loss, and the prompts shared under
gradient checkpointing and in packed micro batches. The engine passes attribute reads through to its
model, but its ``config`` is DeepSpeed's own: read there, these options were silently lost (the cap
applied to the hidden states, the router loss off, every sample's prompt recomputed or padded)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import random_batch

pytest.importorskip("deepspeed")

LR = 1e-3


@pytest.fixture(scope="module")
def gemma2_path(tmp_path_factory):
    """A two-layer Gemma 2 with a cap (0.5) that bends its logits and would bend its hidden states."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhf_plugins.models.folder import save_pretrained, save_tokenizer
    from rlhf_plugins.models.tiny_model import default_model_path

    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma2", vocab_size=512, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  query_pre_attn_scalar=32, final_logit_softcapping=0.5)
    out = tmp_path_factory.mktemp("gemma2")
    save_pretrained(AutoModelForCausalLM.from_config(config, dtype=torch.float32), out)
    save_tokenizer(AutoTokenizer.from_pretrained(default_model_path(quiet=True)), out)
    return str(out)


def _learners(path: str, learner: dict, stage: int):
    from rlhf_plugins.api import prepare
    from rlhf_plugins.learners.deepspeed_learner import DeepSpeedLearner
    from rlhf_plugins.learners.torch_learner import TorchLearner
    from rlhf_plugins.testing import backend_context

    base = {"model": {"path": path}, "train": {"prompts_per_step": 3}, "generation": {"n_samples_per_prompt": 4},
            "learner": {"lr": LR, **learner}}
    torch_cfg, pm, _ = prepare(base, autoload=False)
    ds_cfg, _, _ = prepare({**base, "learner": {**base["learner"], "backend": "deepspeed"},
                            "deepspeed": {"zero_stage": stage}}, autoload=False)
    local = TorchLearner(backend_context(torch_cfg, "actor", path, pm))
    return local, DeepSpeedLearner(backend_context(ds_cfg, "actor", path, pm)), torch_cfg


def _one_update_each(path: str, learner: dict, stage: int):
    """One PPO update of each learner on the same batch (old log-probs the model's own), and what it logged."""
    from rlhf_plugins.algorithms import policy_losses
    from rlhf_plugins.algorithms.objective import Objective

    local, ds, config = _learners(path, learner, stage)
    try:
        batch = random_batch(group=4, prompts=3, seed=5)
        g = torch.Generator().manual_seed(1)
        batch["advantages"] = torch.randn(batch["action_mask"].shape, generator=g) * batch["action_mask"]
        batch["old_logprobs"] = local.logprobs(batch)
        objective = Objective(policy_losses.ppo, config.algo.policy_loss)
        got = ds.train(batch, objective)
        after = dict(ds.named_weights())
    finally:
        ds.shutdown()
    want = local.train(batch, objective)
    worst = max(float((after[k] - v).abs().max()) for k, v in local.named_weights())
    return want, got, worst


@pytest.mark.parametrize("stage", [2, 3])
def test_soft_capped_logits_chunked_through_the_engine_train_as_the_torch_learner(gemma2_path, stage):
    """Two tokens of logits a chunk: the update's forward (through the engine) gives the old log-probs
    back (ratio 1) and the torch learner's gradient and weights; the engine once capped the hidden states."""
    chunk = {"logits_memory_mb": 2 * 512 * 16 / 2**20}
    want, got, worst = _one_update_each(gemma2_path, chunk, stage)
    assert got["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert got["loss/policy"] == pytest.approx(want["loss/policy"], abs=1e-6)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert worst < 0.05 * LR


def test_the_load_balancing_loss_reaches_the_deepspeed_update():
    """--learner.router_aux_loss_coef on a reduced Qwen3-30B-A3B: the DeepSpeed update adds the router
    loss the torch learner adds (logged, same value, same gradient); it was silently left out."""
    from rlhf_plugins.testing import reduced_model_path

    path = reduced_model_path("qwen3-30b-a3b", layers=2, hidden=64)
    want, got, worst = _one_update_each(path, {"router_aux_loss_coef": 0.5}, 2)
    assert want["loss/router_aux"] > 0
    assert got["loss/router_aux"] == pytest.approx(want["loss/router_aux"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert worst < 0.05 * LR


def test_zero3_under_gradient_checkpointing_runs_each_prompt_once(tiny_model, monkeypatch):
    """With checkpointing, the prompts' shared forward needs this package's prompt cache (transformers
    drops a checkpointed layer's cache): through the engine it is made from the model's config, the
    update's embedding sees each prompt once (3 rows, not the 12 samples whole), and the update equals
    the torch learner's."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    from rlhf_plugins.models import prompt_cache

    made, make = [], prompt_cache.prompt_cache
    monkeypatch.setattr(prompt_cache, "prompt_cache", lambda model: made.append(make(model)) or made[-1])
    rows: list[int] = []  # the rows of every embedding call with gradients (the updates)
    hook = register_module_forward_pre_hook(
        lambda module, args: rows.append(args[0].shape[0])
        if isinstance(module, torch.nn.Embedding) and torch.is_grad_enabled() else None)
    try:
        want, got, worst = _one_update_each(tiny_model, {"gradient_checkpointing": True}, 3)
    finally:
        hook.remove()
    assert made and all(cache is not None for cache in made)
    assert rows.count(3) == 2 and rows.count(12) == 2  # each learner: 3 prompts, then 12 completions
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert worst < 0.05 * LR


def test_packed_micro_batches_hold_each_prompt_once_through_the_engine(tiny_model):
    """Token-budget micro batches: through the engine the model attends per sample, so its packed rows
    hold each group's prompt once, as the torch learner's do (the same rows, the same update); the
    engine's config once hid the model's attention and every sample went in whole."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    shapes: list[tuple[int, ...]] = []  # every embedding call with gradients: the DeepSpeed update's, the torch one's
    hook = register_module_forward_pre_hook(
        lambda module, args: shapes.append(tuple(args[0].shape))
        if isinstance(module, torch.nn.Embedding) and torch.is_grad_enabled() else None)
    try:
        want, got, worst = _one_update_each(tiny_model, {"max_tokens_per_micro_batch": 48}, 3)
    finally:
        hook.remove()
    ds, local = shapes[: len(shapes) // 2], shapes[len(shapes) // 2:]
    batch = random_batch(group=4, prompts=3, seed=5)
    whole = int(batch["attention_mask"].sum())  # every sample's prompt and completion
    assert ds == local and all(rows == 1 for rows, _ in ds)
    assert sum(width for _, width in ds) < whole - 2 * 3 * 3  # each prompt (3+ tokens) once, not 4 times
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert worst < 0.05 * LR
