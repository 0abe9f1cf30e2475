from __future__ import annotations

from dataclasses import dataclass

import pytest
import yaml

from rlhf_plugins import ConfigError, PluginError
from rlhf_plugins.config.loading import build_config, load_yaml, merge, parse_overrides
from rlhf_plugins.config.options import OptionRegistry
from rlhf_plugins.config.schema import Config


def test_defaults_and_yaml_roundtrip():
    c = build_config({})
    assert c.algo.advantage.estimator == "group_norm"
    again = build_config(yaml.safe_load(c.to_yaml()))
    assert again.to_dict() == c.to_dict()


def test_overrides_parse_and_win_over_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("algo:\n  advantage:\n    estimator: rloo\ntrain:\n  steps: 7\n  seed: 3\n")
    raw = merge(load_yaml(f), parse_overrides(["--train.steps", "9", "--learner.lr=3e-4", "--reward.functions", "a,b"]))
    c = build_config(raw)
    assert (c.algo.advantage.estimator, c.train.steps, c.train.seed) == ("rloo", 9, 3)
    assert c.learner.lr == pytest.approx(3e-4)
    assert c.reward.functions == ["a", "b"]


def test_optional_and_literal_types():
    c = build_config(parse_overrides(["--algo.policy_loss.dual_clip", "3", "--model.dtype", "bfloat16"]))
    assert c.algo.policy_loss.dual_clip == 3.0 and isinstance(c.algo.policy_loss.dual_clip, float)
    assert build_config(parse_overrides(["--algo.policy_loss.dual_clip", "null"])).algo.policy_loss.dual_clip is None
    with pytest.raises(ConfigError, match="config key 'model.dtype' must be one of 'float32' | 'bfloat16' | 'float16'"):
        build_config({"model": {"dtype": "int8"}})


@pytest.mark.parametrize("word, flag", [("off", False), ("on", True), ("yes", True), ("no", False)])
def test_yaml_11_words_stay_text_in_text_keys_and_work_in_boolean_keys(word, flag):
    c = build_config(parse_overrides(["--train.run_name", word, "--train.progress", word]))
    assert c.train.run_name == word and c.train.progress is flag


@pytest.mark.parametrize("text", ["User: {}\\nAssistant: ", "Q: {}", "{}", "- {}", "[{}]"])
def test_a_flag_whose_text_yaml_reads_as_a_mapping_or_list_stays_text_in_a_text_key(text):
    c = build_config(parse_overrides(["--data.input_template", text, "--train.run_name", text]))
    assert c.data.input_template == text and c.train.run_name == text


def test_flag_mappings_and_lists_stay_values_elsewhere_and_save_as_plain_yaml():
    from rlhf_plugins.config.loading import build_dataclass
    from rlhf_plugins.stages.config import StageConfig

    c = build_config(parse_overrides(["--learner.betas", "[0.8, 0.9]", "--reward.weights", "[1, 2]"]))
    assert c.learner.betas == [0.8, 0.9] and c.reward.weights == [1.0, 2.0]
    s = build_dataclass(parse_overrides(["--trl.model_init_kwargs", "{dtype: bfloat16}"]), StageConfig)
    assert s.trl == {"model_init_kwargs": {"dtype": "bfloat16"}}
    assert yaml.safe_load(yaml.safe_dump(s.to_dict()))["trl"] == s.trl  # plain dicts: safe_dump takes them
    assert yaml.safe_load(yaml.safe_dump(c.to_dict()))["learner"]["betas"] == [0.8, 0.9]


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"algo": {"advantage": {"estimatr": "x"}}}, "unknown config key 'algo.advantage.estimatr'; did you mean 'algo.advantage.estimator'?"),
        ({"trian": {"steps": 1}}, "unknown config key 'trian'; did you mean 'train'?"),
        # the key of its section the short name begins (vLLM's and TRL's n), never the section itself
        ({"generation": {"n": 4}}, "unknown config key 'generation.n'; did you mean 'generation.n_samples_per_prompt'?"),
        ({"generation": {"temp": 1}}, "unknown config key 'generation.temp'; did you mean 'generation.temperature'?"),
        ({"train": {"zzz": 1}}, "unknown config key 'train.zzz'"),
        # a fixed set of choices: another case, a dtype's short name, a close spelling with the same digits
        ({"model": {"dtype": "bf16"}},
         "config key 'model.dtype' must be one of 'float32' | 'bfloat16' | 'float16'; got 'bf16'; did you mean 'bfloat16'?"),
        ({"learner": {"optimizer": "AdamW"}}, "config key 'learner.optimizer' must be one of 'adamw' | 'adam' | 'sgd' | "
         "'muon' | 'adafactor'; got 'AdamW'; did you mean 'adamw'?"),
        ({"learner": {"lr_scheduler": "cosin"}},
         "config key 'learner.lr_scheduler' must be one of 'constant' | 'linear' | 'cosine'; got 'cosin'; did you mean 'cosine'?"),
        ({"model": {"dtype": "float64"}}, "config key 'model.dtype' must be one of 'float32' | 'bfloat16' | 'float16'; got 'float64'"),
        # a bare name: the keys it ends, all of them when there are a few
        ({"steps": 3}, "unknown config key 'steps'; did you mean 'train.steps'?"),
        ({"lr": 1e-5}, "unknown config key 'lr'; did you mean one of 'critic.lr', 'learner.lr'?"),
        ({"train": {"steps": "many"}}, "config key 'train.steps' expects an integer, got 'many'"),
        ({"train": {"steps": 2.5}}, "config key 'train.steps' expects an integer, got 2.5"),
        ({"data": {"shuffle": "yes please"}}, "config key 'data.shuffle' expects true or false, got 'yes please'"),
        ({"train": 5}, "config key 'train' expects a mapping, got 5"),
        ({"learner": {"lr": "fast"}}, "config key 'learner.lr' expects a number, got 'fast'"),
    ],
)
def test_bad_config_is_one_clear_line(raw, message):
    with pytest.raises(ConfigError) as exc:
        build_config(raw)
    assert str(exc.value) == message
    assert "\n" not in str(exc.value)


def test_flags_need_values_and_dashes():
    with pytest.raises(ConfigError, match="flag '--train.steps' needs a value"):
        parse_overrides(["--train.steps"])
    with pytest.raises(ConfigError, match="^unexpected argument 'oops'; config flags look like --section.key value$"):
        parse_overrides(["oops"])
    # a list given as two values (OpenRLHF's --adam_betas 0.9 0.95 is one of its flags of two values)
    with pytest.raises(ConfigError, match=r"^unexpected argument '0.95' after --learner.betas 0.9; a list is one value "
                                          r"\(--learner.betas 0.9,0.95\) and config flags look like --section.key value$"):
        parse_overrides(["--train.steps", "3", "--learner.betas", "0.9", "0.95"])
    assert build_config(parse_overrides(["--learner.betas", "0.9,0.95"])).learner.betas == [0.9, 0.95]  # as it says


@dataclass
class JudgeOptions:
    url: str = "http://127.0.0.1:1/score"
    timeout: float = 10.0


def test_plugin_sections_are_typed():
    options = OptionRegistry()
    options.add_section("judge", JudgeOptions)
    c = build_config(parse_overrides(["--judge.timeout", "2"]), options)
    assert c.section("judge").timeout == 2.0
    assert build_config({}, options).section("judge").url.startswith("http")
    with pytest.raises(ConfigError, match="unknown config key 'judge.timout'; did you mean 'judge.timeout'"):
        build_config({"judge": {"timout": 1}}, options)
    with pytest.raises(PluginError, match="config section 'train' is already defined"):
        options.add_section("train", JudgeOptions)
    assert "judge" in Config().to_dict() or "judge" in c.to_dict()


def test_bad_yaml_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_yaml(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "nope.yaml")
