"""Weight decay leaves biases and normalisation weights alone, as transformers' Trainer (TRL) and OpenRLHF do:
which parameters, on the default model and reduced public architectures, and what one AdamW step of the torch
learner then does to each (``--learner.weight_decay_all`` decays them all). The FSDP2 and DeepSpeed learners
are checked against the torch learner in tests/test_fsdp.py and tests/test_deepspeed_learner.py."""
from __future__ import annotations

import pytest
import torch

from rlhf_plugins.learners.optimizer import undecayed
from tests.helpers import family_model_path, ppo_batch, ppo_update, torch_learner

#: OpenRLHF's get_optimizer_grouped_parameters: a parameter whose name holds one of these is not decayed
OPENRLHF_NO_DECAY = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")


@pytest.mark.parametrize("family", ["default", "gemma2", "glm4", "deepseek_v3"])
def test_the_undecayed_parameters_are_those_trl_and_openrlhf_leave_alone(family):
    from transformers import AutoModelForCausalLM, Trainer

    from rlhf_plugins.models.tiny_model import default_model_path

    path = default_model_path(quiet=True) if family == "default" else family_model_path(family)
    model = AutoModelForCausalLM.from_pretrained(path)
    names = {name for name, _ in model.named_parameters()}
    ours = undecayed(model) & names
    trl = names - set(Trainer.get_decay_parameter_names(None, model))  # what TRL's trainers leave alone
    openrlhf = {name for name in names if any(part in name for part in OPENRLHF_NO_DECAY)}
    assert ours == trl == openrlhf
    assert any(name.endswith("norm.weight") for name in ours)
    assert family != "glm4" or any(name.endswith("bias") for name in ours)  # attention biases


@pytest.mark.parametrize("decay_all", [False, True])
def test_one_adamw_step_decays_the_matrices_and_not_the_norms_and_biases(decay_all):
    """Two float32 learners, weight decay 0.5 and 0, one PPO step on the same batch: AdamW's decoupled decay
    is the whole difference, ``lr x 0.5 x w`` on each decayed weight and nothing on the norms (the default
    model has no biases) -- unless --learner.weight_decay_all."""
    decayed = torch_learner("float32", weight_decay=0.5, weight_decay_all=decay_all)
    plain = torch_learner("float32")
    before = {name: w.clone() for name, w in decayed.named_weights()}
    skip = undecayed(decayed.model)
    assert skip and skip < set(before)
    ppo_update(decayed, ppo_batch())
    ppo_update(plain, ppo_batch())
    after, after_plain = dict(decayed.named_weights()), dict(plain.named_weights())
    lr = decayed.cfg.lr
    for name, w in before.items():
        moved_by_decay = after_plain[name] - after[name]
        expected = torch.zeros_like(w) if name in skip and not decay_all else lr * 0.5 * w
        torch.testing.assert_close(moved_by_decay, expected, rtol=1e-3, atol=1e-7)
