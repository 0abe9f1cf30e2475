"""The learners' optimizers beside Muon's (tests/test_muon.py). Weight decay leaves biases and normalisation
weights alone, as transformers' Trainer (TRL) and OpenRLHF do: which parameters, on the default model and
reduced public architectures, and what one AdamW step of the torch learner then does to each
(``--learner.weight_decay_all`` decays them all); the FSDP2 and DeepSpeed learners are checked against the
torch learner in tests/test_fsdp.py and tests/test_deepspeed_learner.py. Adafactor (TRL's optim adafactor):
the torch learner's steps against transformers' Adafactor made as TRL's Trainer makes it, its states in the
memory plan."""
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


def test_trls_adafactor_converts_and_steps_as_trls_trainer_makes_it():
    """TRL's optim adafactor: the torch learner's two updates move the weights as transformers' Adafactor made
    the Trainer's way (scale_parameter and relative_step off, lr, decay groups) moves copies given the same
    gradients (no clipping, so the accumulated gradients are the step's); the memory plan's state elements are
    the step's."""
    pytest.importorskip("trl")
    from transformers.optimization import Adafactor

    from rlhf_plugins.api import prepare
    from rlhf_plugins.integrations.trl_config import from_grpo_fields
    from rlhf_plugins.models.memory import MemoryInputs, ModelShape, torch_learner_memory
    from rlhf_plugins.models.tiny_model import default_model_path

    raw, _ = from_grpo_fields({"optim": "adafactor", "weight_decay": 0.1})
    assert raw["learner"]["optimizer"] == "adafactor" and raw["learner"]["weight_decay"] == 0.1
    learner = torch_learner("float32", optimizer="adafactor", weight_decay=0.1, max_grad_norm=0.0)
    named = [(name, w.detach().clone().requires_grad_(True)) for name, w in learner.named_weights()]
    skip = undecayed(learner.model)
    start = {n: w.detach().clone() for n, w in named}
    theirs = Adafactor([{"params": [w for n, w in named if n not in skip]},
                        {"params": [w for n, w in named if n in skip], "weight_decay": 0.0}],
                       lr=learner.cfg.lr, scale_parameter=False, relative_step=False, weight_decay=0.1)
    for seed in (5, 6):
        captured: dict[str, torch.Tensor] = {}
        hooks = [w.register_post_accumulate_grad_hook(lambda p, n=n, c=captured: c.__setitem__(n, p.grad.clone()))
                 for n, w in learner.model.named_parameters()]
        ppo_update(learner, ppo_batch(seed))
        for hook in hooks:
            hook.remove()
        for name, w in named:
            w.grad = captured[name]
        theirs.step()
    after = dict(learner.named_weights())
    worst = max(float((after[n] - w.detach()).abs().max()) for n, w in named)
    moved = max(float((after[n] - before).abs().max()) for n, before in start.items())
    assert worst < 1e-7 and moved > 0.1 * learner.cfg.lr, (worst, moved)
    real = sum(t.numel() for state in learner.optimizer.state.values() for k, t in state.items()
               if k.startswith("exp_avg_sq"))
    config, _, _ = prepare({"learner": {"optimizer": "adafactor"}, "model": {"dtype": "float32"}}, autoload=False)
    shape = ModelShape.of_folder(default_model_path(quiet=True))
    plan = torch_learner_memory(MemoryInputs(config, shape, "actor", 1, shape.parameters, 0, 0))
    assert plan["optimizer states"] == 4 * real < 4 * shape.parameters / 4  # factored: a small fraction


def test_a_checkpoint_whose_optimizer_decayed_everything_resumes_with_weight_decay_all(tmp_path):
    """A checkpoint written when every parameter was decayed (one param group) is one line naming the flag that
    resumes it, and resumes with it."""
    from rlhf_plugins.errors import UsageError

    old = torch_learner("float32", weight_decay=0.1, weight_decay_all=True)
    ppo_update(old, ppo_batch())
    old.save_checkpoint(str(tmp_path))
    with pytest.raises(UsageError, match="resume it with --learner.weight_decay_all true"):
        torch_learner("float32", weight_decay=0.1).load_checkpoint(str(tmp_path))
    again = torch_learner("float32", weight_decay=0.1, weight_decay_all=True)
    again.load_checkpoint(str(tmp_path))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(again.named_weights(), old.named_weights()))


def test_a_run_begun_before_weight_decay_all_existed_resumes_decaying_everything(rlhf):
    """A run whose config.yaml predates ``learner.weight_decay_all`` (every parameter was decayed then, one param
    group) resumes with it true, as it ran; giving it false is a change of config. A checkpoint that cannot load
    (the key edited to false) is one line naming the run's last complete step, which its status keeps."""
    import json
    from pathlib import Path

    import yaml

    from tests.helpers import short_run

    flags = ["--learner.weight_decay", "0.1", "--train.save_every", "2", "--train.run_name", "old"]
    code, _, err = rlhf("train", *short_run("--train.steps", "4"), *flags, "--learner.weight_decay_all", "true")
    assert code == 0, err
    run = Path("runs/old")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    del saved["learner"]["weight_decay_all"]
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    code, out, err = rlhf("train", "--resume", str(run), "--train.steps", "6", "--train.progress", "false")
    assert code == 0, err
    assert "after step 4" in out and json.loads((run / "summary.json").read_text())["steps"] == 6
    code, _, err = rlhf("train", "--resume", str(run), "--train.steps", "8", "--learner.weight_decay_all", "false")
    assert code == 2 and "learner.weight_decay_all (True -> False)" in err, err
    saved["learner"]["weight_decay_all"] = False
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    code, _, err = rlhf("train", "--resume", str(run), "--train.steps", "8", "--train.progress", "false")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "optimizer decays every parameter" in err and "(last complete step 6)" in err, err
    assert json.loads((run / "status.json").read_text())["steps_done"] == 6
