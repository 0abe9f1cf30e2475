"""Reward models in the loop: both saved formats, scores checked against transformers' own
sequence-classification forward and a hand-computed OpenRLHF head, batching, a model with its
own chat template, the critic started from a reward model, and bad reward-model folders."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhf_plugins.models.reward_model import RewardModelScorer, inspect_reward_model
from tests.helpers import make_reward_model, metrics_of, short_run, the_run

PROMPTS = ["3+4=", "1+1=", "9+9=", "2+5=", "0+0="]
COMPLETIONS = ["7", "3", "18", "7 and more", ""]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model):
    base = tmp_path_factory.mktemp("rm")
    return {"trl": make_reward_model(base / "trl", "trl", seed=1),
            "openrlhf": make_reward_model(base / "openrlhf", "openrlhf", seed=1, mean=0.5, std=2.0)}


def test_formats_are_recognised(models):
    trl, orl = inspect_reward_model(models["trl"]), inspect_reward_model(models["openrlhf"])
    assert (trl.kind, trl.head) == ("sequence-classification", "score.weight")
    assert (orl.kind, orl.head, orl.mean, orl.std) == ("openrlhf", "score.weight", 0.5, 2.0)


def test_trl_format_scores_equal_transformers_own_forward(models):
    from transformers import AutoModelForSequenceClassification

    scorer = RewardModelScorer(str(models["trl"]), batch_size=2)
    got = scorer(PROMPTS, COMPLETIONS)
    reference = AutoModelForSequenceClassification.from_pretrained(models["trl"]).eval()
    for prompt, completion, score in zip(PROMPTS, COMPLETIONS, got):
        ids = torch.tensor([scorer.render(prompt, completion)])
        with torch.no_grad():
            expected = float(reference(input_ids=ids).logits[0, 0])
        assert score == pytest.approx(expected, abs=1e-4)


def test_openrlhf_format_scores_at_the_last_token_with_its_normalisation_only_when_asked(models):
    """Its stored mean / std apply with --reward.normalize (OpenRLHF's --normalize_reward), not otherwise."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    scorer = RewardModelScorer(str(models["openrlhf"]), normalize=True)
    got = scorer(PROMPTS, COMPLETIONS)
    raw = RewardModelScorer(str(models["openrlhf"]))(PROMPTS, COMPLETIONS)
    assert raw == pytest.approx([g * 2.0 + 0.5 for g in got], abs=1e-4)
    backbone = AutoModel.from_pretrained(models["openrlhf"]).eval()
    head = load_file(str(models["openrlhf"] / "model.safetensors"))["score.weight"]
    for prompt, completion, score in zip(PROMPTS, COMPLETIONS, got):
        ids = scorer.render(prompt, completion)
        assert ids[-1] == scorer.tokenizer.eos_token_id  # the chat template closes the turn with EOS
        with torch.no_grad():
            hidden = backbone(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        assert score == pytest.approx((float(hidden @ head[0]) - 0.5) / 2.0, abs=1e-4)


def test_batching_changes_no_score(models):
    one = RewardModelScorer(str(models["trl"]), batch_size=1)(PROMPTS, COMPLETIONS)
    many = RewardModelScorer(str(models["trl"]), batch_size=64)(PROMPTS, COMPLETIONS)
    assert many == pytest.approx(one, abs=1e-5)


def test_a_reward_model_with_its_own_chat_template_renders_from_text(models, tmp_path):
    import shutil

    folder = tmp_path / "other"
    shutil.copytree(models["trl"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    scorer = RewardModelScorer(str(folder))
    text = scorer.tokenizer.decode(scorer.render("3+4=", "7"))
    assert text == "[user] 3+4=\n[assistant] 7\n"


@pytest.mark.parametrize("case, expected", [
    ("missing", "is not a save_pretrained folder (no config.json)"),
    ("causal", "is not a reward model: no sequence-classification head and no value head named score or value_head"),
    ("labels", "has a head with 3 labels; a reward model scores with one"),
    ("no-tokenizer", "has no tokenizer; save the tokenizer beside it"),
])
def test_bad_reward_model_folders_are_one_line(rlhf, tmp_path, tiny_model, case, expected):
    folder = tmp_path / case
    if case == "causal":
        folder = Path(tiny_model)
    elif case == "labels":
        make_reward_model(folder, "trl", labels=3)
    elif case == "no-tokenizer":
        make_reward_model(folder, "trl")
        for f in folder.glob("tok*"):
            f.unlink()
    code, _, err = rlhf("train", "--reward.models", str(folder), *short_run())
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not Path("runs").exists() or not any(Path("runs").iterdir())


def test_reward_models_beside_functions_are_weighted_and_logged_by_name(rlhf, models):
    code, _, err = rlhf("train", "--reward.functions", "exact_match", "--reward.models",
                        f"{models['trl']},{models['openrlhf']}", "--reward.weights", "1,0.5,0.25", *short_run())
    assert code == 0, err
    rows = metrics_of(the_run())
    assert all({"reward/exact_match", "reward/trl", "reward/openrlhf"} <= set(r) for r in rows)
    for r in rows:
        combined = r["reward/exact_match"] + 0.5 * r["reward/trl"] + 0.25 * r["reward/openrlhf"]
        assert r["reward/mean"] == pytest.approx(combined, abs=1e-4)


def test_only_a_reward_model_scores_when_no_function_is_named(rlhf, models):
    code, _, err = rlhf("train", "--reward.models", str(models["trl"]), *short_run())
    assert code == 0, err
    import yaml

    saved = yaml.safe_load((the_run() / "config.yaml").read_text())
    assert saved["reward"]["functions"] == [] and saved["reward"]["weights"] == [1.0]


def test_the_critic_starts_from_the_reward_model(models):
    """Per-token values of a critic loaded from a reward model, at each sample's last token, are
    that reward model's scores (normalisation included)."""
    from rlhf_plugins.models.value_model import ValueModel

    for kind in ("trl", "openrlhf"):
        scorer = RewardModelScorer(str(models[kind]))
        critic = ValueModel.from_pretrained(str(models[kind])).eval()
        for prompt, completion, score in zip(PROMPTS, COMPLETIONS, scorer(PROMPTS, COMPLETIONS)):
            ids = torch.tensor([scorer.render(prompt, completion)])
            with torch.no_grad():
                values = critic(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :, 0]
            assert float(values[-1]) == pytest.approx(score, abs=1e-4), kind


def test_ppo_with_the_critic_from_the_reward_model(rlhf, models):
    code, _, err = rlhf("train", "--algo.advantage.estimator", "gae", "--critic.path", str(models["trl"]),
                        "--reward.models", str(models["trl"]), *short_run())
    assert code == 0, err
    rows = metrics_of(the_run())
    assert all("critic/loss" in r for r in rows) and rows[0]["critic/values"] != 0.0  # not a zero head


def test_model_normalize_applies_a_reward_models_stored_stats_alone(rlhf, models):
    """OpenRLHF's --normalize_reward (``--reward.model_normalize``) applies the model's stored mean / std to its
    scores and nothing else; ``--reward.normalize`` also normalises the scores by running statistics."""
    firsts = {}
    for name, flags in (("raw", ()), ("model", ("--reward.model_normalize", "true")),
                        ("running", ("--reward.normalize", "true"))):
        code, _, err = rlhf("train", "--reward.models", str(models["openrlhf"]), *flags,
                            *short_run("--train.run_name", name))
        assert code == 0, err
        firsts[name] = metrics_of(Path("runs") / name)[0]  # step 0: the same samples in every run
    raw, model, running = firsts["raw"], firsts["model"], firsts["running"]
    assert model["reward/mean"] == pytest.approx((raw["reward/mean"] - 0.5) / 2.0, abs=1e-4)
    assert "reward/shaped_mean" not in model  # the scores the advantages see are the model's own
    assert running["reward/mean"] == pytest.approx(model["reward/mean"], abs=1e-4)
    assert abs(running["reward/shaped_mean"]) < 1e-4  # running statistics of the first batch centre it
