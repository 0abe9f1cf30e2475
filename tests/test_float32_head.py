"""--model.fp32_lm_head (rlhf_plugins.models.float32_head; TRL's cast_lm_head_to_fp32): in a bfloat16 model
the output head keeps float32 weights and computes float32 logits from the decoder's 16-bit output, in the
learner (trained as its own master), the reference and the transformers engine; checked against float64
formulas on random inputs, with the 16-bit head as the foil that the checks would catch."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    check_one_line_error,
    in_process_trainer,
    metrics_of,
    ppo_batch,
    ppo_update,
    short_run,
    the_run,
    torch_learner,
)

F64 = torch.float64


def _loaded(path: str, role: str = "actor", **model: object) -> torch.nn.Module:
    from rlhf_plugins.api import prepare

    config, pm, _ = prepare({"model": {"dtype": "bfloat16", "fp32_lm_head": True, **model}}, autoload=False)
    return pm.load_model(role, path, config)


@pytest.fixture(params=["tiny", "qwen-tied"])
def model_path(request, tiny_model):
    from rlhf_plugins.testing import reduced_model_path

    return tiny_model if request.param == "tiny" else reduced_model_path()


def test_the_head_is_float32_and_the_decoder_16_bit(model_path):
    model = _loaded(model_path)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = model.config.tie_word_embeddings
    assert head.weight.dtype == torch.float32 and (embedding.weight is head.weight) == tied
    others = [n for n, p in model.named_parameters() if p is not head.weight]
    assert others and all(dict(model.named_parameters())[n].dtype == torch.bfloat16 for n in others)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert embedding(ids).dtype == torch.bfloat16  # a tied float32 embedding hands the decoder 16 bits
    from rlhf_plugins.models.float32_head import weights_dtype

    assert weights_dtype(model) == torch.bfloat16


@pytest.mark.parametrize("autocast", [False, True])
def test_the_logits_are_the_float32_product_of_the_decoders_16_bit_output(model_path, autocast):
    """Against the float64 product of the same hidden states and weights: the float32 head within float32
    rounding, where the 16-bit head's logits are off by bf16 rounding (hundreds of times more); under
    autocast (the --learner.master_weights false learner) the head still computes in float32."""
    model = _loaded(model_path).eval()
    head = model.get_output_embeddings()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = model.model(input_ids=ids).last_hidden_state
        logits = model(input_ids=ids).logits
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
    want = hidden.to(F64) @ head.weight.to(F64).T
    err32 = (logits.to(F64) - want).abs().max().item()
    err16 = (torch.nn.functional.linear(hidden, head.weight.bfloat16()).to(F64) - want).abs().max().item()
    scale = want.abs().max().item()
    assert err32 < 1e-5 * scale and err16 > 100 * err32, (err32, err16, scale)


@pytest.mark.parametrize("autocast", [False, True])
def test_chunked_log_probs_entropy_and_gradients_follow_the_float32_head(autocast):
    """The chunked fused head on a float32 head (Qwen2.5's vocabulary, tied) and 16-bit hidden states:
    log-probs and entropy, and the gradients of the head's weight and of the hidden states, against
    float64 autograd of the same formula; the weight's gradient is float32 and handed to autograd."""
    from rlhf_plugins.models.logits import head_token_stats
    from rlhf_plugins.testing import reduced_model_path

    head = _loaded(reduced_model_path()).get_output_embeddings()
    g = torch.Generator().manual_seed(2)
    hidden = (torch.randn(3, 7, head.in_features, generator=g) * 2).bfloat16().requires_grad_()
    tokens = torch.randint(0, head.out_features, (3, 7), generator=g)
    g_lp, g_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        lp, ent = head_token_stats(head, hidden, tokens, 0.7, True, chunk=5)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()

    h64 = hidden.detach().to(F64).requires_grad_()
    w64 = head.weight.detach().to(F64).requires_grad_()
    logp = torch.log_softmax(h64 @ w64.T / 0.7, dim=-1)
    lp64 = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ent64 = -(logp.exp() * logp).sum(-1)
    ((lp64 * g_lp).sum() + (ent64 * g_ent).sum()).backward()
    torch.testing.assert_close(lp.to(F64), lp64.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(ent.to(F64), ent64.detach(), rtol=0, atol=2e-5)
    assert head.weight.grad.dtype == torch.float32
    torch.testing.assert_close(head.weight.grad.to(F64), w64.grad, rtol=1e-4, atol=1e-7)
    assert hidden.grad.dtype == torch.bfloat16
    torch.testing.assert_close(hidden.grad.to(F64), h64.grad, rtol=2e-2, atol=2e-3)


def test_the_learner_trains_the_float32_head_as_its_own_master():
    """bf16 weights with float32 masters, and the float32 head stepped by the optimizer itself (no
    master of it, no 16-bit copy, its AdamW states float32): after an update the head moved, holding
    values a 16-bit head could not, and every 16-bit weight equals its master."""
    lr = torch_learner(fp32_lm_head=True)
    head = lr.model.get_output_embeddings().weight
    stepped = [p for group in lr.optimizer.param_groups for p in group["params"]]
    assert any(p is head for p in stepped) and all(p is not head for _, p in lr.masters.named)
    assert len(stepped) == len(lr.masters.masters) + 1 and all(p.dtype == torch.float32 for p in stepped)
    before = head.detach().clone()
    assert ppo_update(lr, ppo_batch())["grad_norm"] > 0
    assert head.dtype == torch.float32 and not torch.equal(head, before)
    assert not torch.equal(head, head.bfloat16().float())  # float32 values a 16-bit head could not hold
    assert lr.optimizer.state[head]["exp_avg"].dtype == torch.float32
    for (_, p), master in zip(lr.masters.named, lr.masters.masters):
        assert p.dtype == torch.bfloat16 and torch.equal(p, master.to(torch.bfloat16))


def test_a_checkpoint_of_the_float32_head_resumes_exactly(tmp_path):
    first = torch_learner(fp32_lm_head=True)
    ppo_update(first, ppo_batch(1))
    first.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = torch_learner(fp32_lm_head=True)
    head = resumed.model.get_output_embeddings().weight
    assert not torch.equal(head, first.model.get_output_embeddings().weight)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(p, q) for p, q in zip(first.model.parameters(), resumed.model.parameters()))
    assert ppo_update(first, ppo_batch(2)) == ppo_update(resumed, ppo_batch(2))
    assert torch.equal(head, first.model.get_output_embeddings().weight)


def test_the_plan_counts_the_float32_head_once():
    """16-bit weights beside float32 masters, with the head in float32 and no master of it: 2 bytes more
    per head element in the weights, 4 fewer in the masters; the reference and the transformers engine
    hold the 2 bytes more."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.models.memory import (
        MemoryInputs,
        ModelShape,
        reference_memory,
        torch_learner_memory,
        transformers_engine_memory,
    )
    from rlhf_plugins.models.shapes import shape_config

    shape = ModelShape.from_config(shape_config("qwen2.5-0.5b"))
    P, head = shape.parameters, shape.vocab * shape.hidden
    parts = {}
    for on in (False, True):
        config, _, _ = prepare({"model": {"dtype": "bfloat16", "fp32_lm_head": on}}, autoload=False)
        inputs = MemoryInputs(config, shape, "actor", ranks=1, trainable=P, micro_tokens=0, logits_bytes=0)
        parts[on] = [torch_learner_memory(inputs), reference_memory(inputs), transformers_engine_memory(inputs)]
    (learner, reference, engine), (learner32, reference32, engine32) = parts[False], parts[True]
    assert learner32["float32 head"] == 2 * head and "float32 head" not in learner
    assert learner32["fp32 master weights"] == learner["fp32 master weights"] - 4 * head == 4 * (P - head)
    assert reference32["float32 head"] == engine32["float32 head"] == 2 * head
    assert "float32 head" not in reference and "float32 head" not in engine
    assert reference32["weights"] == reference["weights"] and engine32["weights"] == engine["weights"]
    assert sum(learner32.values()) == sum(learner.values()) - 2 * head


def test_a_run_keeps_the_head_float32_in_every_role_and_its_engine_agrees_with_its_learner():
    """Two GRPO steps on Qwen2.5's shape (tied, real vocabulary) in bfloat16: the learner, the reference
    and the transformers engine hold float32 heads (the engine the learner's own tensors), the head
    trains (an entropy bonus: the random model's rewards are all 0), and the engine's log-probs of its
    samples equal the learner's recomputation."""
    from rlhf_plugins.testing import reduced_model_path

    path = reduced_model_path()
    t = in_process_trainer(path, {
        "model": {"path": path, "dtype": "bfloat16", "fp32_lm_head": True}, "train": {"prompts_per_step": 2},
        "generation": {"n_samples_per_prompt": 4, "max_new_tokens": 6}, "algo": {"kl": {"coef": 0.01}, "policy_loss": {"entropy_coef": 0.01}},
        "learner": {"lr": 1e-3}, "eval": {"enabled": False}})
    try:
        heads = {role: model.get_output_embeddings().weight
                 for role, model in (("actor", t.actor.learner.model), ("reference", t.reference.model),
                                     ("generation", t.engine.engine.model))}
        assert all(w.dtype == torch.float32 for w in heads.values()), {r: w.dtype for r, w in heads.items()}
        assert heads["generation"].data_ptr() == heads["actor"].data_ptr()  # shared, not copied
        before = heads["actor"].detach().clone()
        metrics = [t.step(step) for step in range(2)]
        assert not torch.equal(heads["actor"], before) and torch.equal(heads["reference"], before)
        assert all(m["mismatch/abs_log_ratio"] < 1e-6 for m in metrics), [m["mismatch/abs_log_ratio"] for m in metrics]
    finally:
        t.shutdown()


def test_the_cli_trains_with_a_float32_head(rlhf):
    """``rlhf train --model.dtype bfloat16 --model.fp32_lm_head true``: three updates, and the saved policy
    holds its trained head in float32 beside the 16-bit decoder."""
    from safetensors import safe_open

    code, out, err = rlhf("train", "--model.dtype", "bfloat16", "--model.fp32_lm_head", "true", *short_run())
    assert code == 0, err
    rows = [r for r in metrics_of(the_run()) if "grad_norm" in r]
    assert len(rows) == 3 and all(r["grad_norm"] > 0 for r in rows)
    with safe_open(str(the_run() / "final" / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes.pop("lm_head.weight") == "F32" and set(dtypes.values()) == {"BF16"}, dtypes


def test_an_adapter_on_the_head_found_at_load_is_one_line_and_leaves_no_run(rlhf, tmp_path):
    """A LoRA config whose pattern reaches lm_head (no name to check before the model loads) stops the run
    when the head turns out to be a LoRA layer: one line, exit 2, no run directory."""
    import json

    (tmp_path / "adapter_config.json").write_text(json.dumps({
        "r": 4, "lora_alpha": 8, "target_modules": ".*(q_proj|lm_head)", "peft_type": "LORA", "task_type": "CAUSAL_LM"}))
    code, _, err = rlhf("train", "--lora.config", str(tmp_path), "--model.dtype", "bfloat16",
                        "--model.fp32_lm_head", "true", *short_run())
    check_one_line_error(code, err, "model.fp32_lm_head needs a plain linear output head, and the model has a peft "
                                    "Linear output head (a LoRA adapter on lm_head is one: drop lm_head from "
                                    "--lora.target_modules); drop --model.fp32_lm_head")
