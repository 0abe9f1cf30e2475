"""--learner.disable_dropout (rlhf_plugins.models.dropout; TRL's disable_dropout): a model whose config keeps
dropout -- Seed-OSS's attention and residual dropout of 0.1, handed to functional dropout and to the attention
function from module attributes, and OPT's torch.nn.Dropout modules -- trains without it in the actor and the
critic, a LoRA adapter's own dropout kept; with the option off the training forward stays random. Converted
TRL configs and OpenRLHF commands keep their dropout, as both of those run it."""
from __future__ import annotations

import pytest
import torch

SEED_OSS = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, attention_dropout=0.1, residual_dropout=0.1)
OPT = dict(vocab_size=512, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=2, dropout=0.1,
           attention_dropout=0.1, word_embed_proj_dim=64)


def _model(model_type: str, fields: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), attn_implementation="eager")


def _two_training_forwards(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    model.train()
    first, second = model(ids).logits, model(ids).logits
    model.eval()
    with torch.no_grad():
        return first, second, model(ids).logits


@pytest.mark.parametrize("model_type,fields", [("seed_oss", SEED_OSS), ("opt", OPT)], ids=["seed-oss", "opt"])
def test_a_training_forward_without_dropout_is_the_eval_forward_and_the_config_is_untouched(model_type, fields):
    from rlhf_plugins.models.dropout import disable_dropout

    model = _model(model_type, fields)
    first, second, _ = _two_training_forwards(model)
    assert (first - second).abs().max() > 1e-3  # dropout on: two training forwards differ
    assert disable_dropout(model, "actor") > 0
    first, second, evaluated = _two_training_forwards(model)
    assert torch.equal(first, second) and torch.equal(first, evaluated)
    assert all(model.config.to_dict()[key] == fields[key] for key in fields if "dropout" in key)


def test_a_lora_adapters_own_dropout_stays():
    from peft import LoraConfig, get_peft_model

    from rlhf_plugins.models.dropout import disable_dropout

    lora = get_peft_model(_model("seed_oss", SEED_OSS), LoraConfig(r=4, lora_dropout=0.2, target_modules=["q_proj"]))
    disable_dropout(lora, "actor")
    adapters = [m for n, m in lora.named_modules() if n.endswith("lora_dropout.default")]
    assert len(adapters) == 2 and all(m.p == 0.2 for m in adapters)
    assert all(m.attention_dropout == 0 for n, m in lora.named_modules() if n.endswith("self_attn"))


@pytest.mark.parametrize("disable", [True, False])
def test_the_learner_loads_its_model_with_dropout_as_the_option_says(tmp_path, disable):
    """The actor's and the critic's models (any learner: the manager's load_model) lose their dropout; the
    reference and the engine run in eval mode, where it does nothing, and are left as they are."""
    from transformers import AutoTokenizer

    from rlhf_plugins.api import prepare
    from rlhf_plugins.models.tiny_model import default_model_path

    folder = tmp_path / "seed-oss"
    _model("seed_oss", SEED_OSS).save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_model_path(quiet=True)).save_pretrained(folder)
    config, pm, _ = prepare({"model": {"path": str(folder)}, "learner": {"disable_dropout": disable}}, autoload=False)
    for role in ("actor", "critic", "reference"):
        model = pm.load_model(role, str(folder), config)
        kept = [m.residual_dropout for n, m in model.named_modules() if n.endswith("mlp")]
        assert kept == [0.0 if disable and role != "reference" else 0.1] * 2, role


def test_trl_configs_keep_trls_default_of_dropout_on():
    pytest.importorskip("trl")
    from rlhf_plugins.integrations.trl_config import from_grpo_fields

    assert from_grpo_fields({})[0]["learner"]["disable_dropout"] is False
    assert from_grpo_fields({"disable_dropout": True})[0]["learner"]["disable_dropout"] is True


def test_openrlhf_commands_keep_openrlhfs_dropout_on():
    """OpenRLHF's Actor trains the model as loaded, dropout included: the converter carries that."""
    from rlhf_plugins.commands.convert import convert

    conv = convert("python3 -m openrlhf.cli.train_ppo_ray --pretrain MODEL --prompt_data DATA".split())
    assert conv.raw["learner"]["disable_dropout"] is False
