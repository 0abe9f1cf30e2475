"""--learner.router_aux_loss_coef (rlhf_plugins.models.router_loss; TRL's router_aux_loss_coef, OpenRLHF's
--aux_loss_coef): a mixture of experts' load-balancing loss in the policy's update, checked against the loss
transformers computes for the same samples run whole, on a reduced Qwen3-30B-A3B (128 experts, 8 per token)."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import ppo_batch

LR, COEF = 0.5, 0.5


@pytest.fixture(scope="module")
def moe_path():
    from rlhf_plugins.testing import reduced_model_path

    return reduced_model_path("qwen3-30b-a3b", layers=2, hidden=64)


def _learner(path: str, **learner: object):
    from rlhf_plugins.api import prepare
    from rlhf_plugins.learners.torch_learner import TorchLearner
    from rlhf_plugins.testing import backend_context

    raw = {"model": {"path": path}, "train": {"prompts_per_step": 3}, "generation": {"n_samples_per_prompt": 4},
           "learner": {"optimizer": "sgd", "lr": LR, "max_grad_norm": 0.0, **learner}}
    config, pm, _ = prepare(raw, autoload=False)
    return TorchLearner(backend_context(config, "actor", path, pm)), config


def _objective(config):
    from rlhf_plugins.algorithms import policy_losses
    from rlhf_plugins.algorithms.objective import Objective

    return Objective(policy_losses.ppo, config.algo.policy_loss)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_update_adds_the_load_balancing_loss_transformers_computes_for_whole_samples(moe_path, checkpointing):
    """One SGD step of PPO-clip + COEF x the router loss: every weight lands where a step on the same
    loss computed independently lands -- the policy loss on every sample run whole, plus transformers'
    aux_loss of that forward (attention mask and all) -- and the logged router loss is that aux_loss;
    also with gradient checkpointing (the router logits' backward recomputes their layers). Without the
    term (coefficient 0) the routers land elsewhere."""
    from rlhf_plugins.models.forward import policy_forward, position_ids

    learner, config = _learner(moe_path, router_aux_loss_coef=COEF, gradient_checkpointing=checkpointing)
    model = copy.deepcopy(learner.model)
    batch = ppo_batch()
    whole = dict(batch, group_size=1)
    out = model(input_ids=whole["sequences"], attention_mask=whole["attention_mask"],
                position_ids=position_ids(whole["attention_mask"]), output_router_logits=True)
    aux = out.aux_loss
    loss, _ = _objective(config)(policy_forward(model, whole), whole)
    (loss + COEF * aux).backward()
    want = {n: p.detach() - LR * p.grad for n, p in model.named_parameters()}

    metrics = learner.train(batch, _objective(config))
    assert metrics["loss/router_aux"] == pytest.approx(aux.item(), rel=1e-5)
    got = dict(learner.model.named_parameters())
    for name, value in want.items():
        torch.testing.assert_close(got[name].detach(), value, rtol=0, atol=1e-6, msg=name)
    assert not learner.model.config.output_router_logits  # asked for during the update only

    plain, _ = _learner(moe_path)
    assert "loss/router_aux" not in plain.train(batch, _objective(config))
    gate = next(n for n in want if n.endswith("mlp.gate.weight"))
    moved = (dict(plain.model.named_parameters())[gate] - got[gate]).abs().max()
    assert moved > 1e-4, float(moved)


@pytest.mark.parametrize("per_sample", [True, False], ids=["one-row", "rows-with-pad-slots"])
def test_packed_micro_batches_take_the_same_load_balancing_loss(moe_path, per_sample, monkeypatch):
    """A token budget that holds the whole batch in one packed micro batch: the same router loss and the
    same update as the padded micro batch -- in one row (attention per sample), and in rows as long as the
    longest sample, whose pad slots count no more than the padded batch's padding does."""
    from rlhf_plugins.models import attention

    if not per_sample:  # as for a model whose attention cannot run per sample
        monkeypatch.setattr(attention, "enable", lambda model: False)
    batch = ppo_batch()
    padded, config = _learner(moe_path, router_aux_loss_coef=COEF)
    packed, _ = _learner(moe_path, router_aux_loss_coef=COEF, max_tokens_per_micro_batch=4096)
    a, b = padded.train(batch, _objective(config)), packed.train(batch, _objective(config))
    assert a["loss/router_aux"] == pytest.approx(b["loss/router_aux"], rel=1e-5)
    for (name, p), q in zip(padded.model.named_parameters(), packed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("masked", [True, False])
def test_the_loss_and_its_gradient_are_transformers_load_balancing_loss_on_random_routings(masked):
    """Against transformers' own function (Qwen3-MoE's, which Mixtral's and the others copy) on random
    router logits of 3 layers x 5 x 7 positions over 16 experts, top 4, with a random padding mask or
    none: the value and the gradient of the logits."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from rlhf_plugins.models.router_loss import switch_loss

    g = torch.Generator().manual_seed(0)
    ours = tuple((torch.randn(35, 16, generator=g) * 2).requires_grad_() for _ in range(3))
    theirs = tuple(t.detach().clone().requires_grad_() for t in ours)
    mask = (torch.rand(5, 7, generator=g) > 0.3).long() if masked else torch.ones(5, 7, dtype=torch.long)
    got = switch_loss(ours, 16, 4, mask)
    want = load_balancing_loss_func(theirs, 16, 4, mask if masked else None)
    got.backward(), want.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-8)
    assert want.item() > 1.0  # top-4 of 16: the balanced value is 4; a check that compares zeros cannot fail


def test_the_coefficient_is_the_settings_or_the_models_own(moe_path, tiny_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_plugins.models.router_loss import coefficient

    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(moe_path))
        dense = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    assert coefficient(moe, None) == moe.config.router_aux_loss_coef == 0.001  # TRL's default: the model's own
    assert coefficient(moe, 0.02) == 0.02 and coefficient(moe, 0.0) == 0.0
    assert coefficient(dense, None) == 0.0


def test_trl_and_openrlhf_configs_carry_it_over():
    from rlhf_plugins.commands.convert import convert
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    assert from_grpo_fields({})[0]["learner"]["router_aux_loss_coef"] is None  # the model's own, as TRL does
    assert from_grpo_fields({"router_aux_loss_coef": 0.0})[0]["learner"]["router_aux_loss_coef"] == 0.0
    converted = convert(["--aux_loss_coef", "0.01"])
    assert converted.raw["learner"]["router_aux_loss_coef"] == 0.01
    assert "--aux_loss_coef" in dict(converted.partial)


def test_an_earlier_trls_numeric_default_converts_as_the_models_own(monkeypatch):
    """TRL 1.7's GRPOConfig defaulted router_aux_loss_coef to 0.001 ("only has an effect when training a
    Mixture-of-Experts model"), which, carried as a number, had every dense model's run refused: left at that
    default it is the model's own coefficient, as in later releases; set explicitly, it is carried."""
    from rlhf_plugins.integrations import trl_config
    from rlhf_plugins.integrations.trl_fields import current_defaults

    installed = trl_config.trl_defaults("grpo")
    earlier = {**installed, "router_aux_loss_coef": 0.001}
    assert current_defaults(earlier) == {**installed, "router_aux_loss_coef": None}
    assert current_defaults({**installed, "router_aux_loss_coef": None}) == {**installed, "router_aux_loss_coef": None}
    monkeypatch.setattr(trl_config, "trl_defaults", lambda trainer: dict(earlier))
    assert trl_config.from_grpo_fields({})[0]["learner"]["router_aux_loss_coef"] is None
    assert trl_config.from_grpo_fields({"router_aux_loss_coef": 0.001})[0]["learner"]["router_aux_loss_coef"] == 0.001
