"""TRL configs and reward callables, OpenRLHF reward files, PEFT LoRA with both sync modes."""
from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.helpers import (
    ROOT,
    block_import,
    check_one_line_error,
    clean_env,
    metrics_of,
    needs_release_with,
    no_run_dirs,
    samples_of,
    short_run,
    the_run,
)

pytest.importorskip("trl")
pytest.importorskip("peft")

from rlhf_plugins.errors import ConfigError  # noqa: E402
from rlhf_plugins.integrations.trl import from_grpo_fields, trl_defaults  # noqa: E402


def test_grpo_fields_map_by_hand():
    raw, notes = from_grpo_fields({
        "learning_rate": 3e-6, "num_generations": 4, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
        "steps_per_generation": 4, "max_completion_length": 64, "beta": 0.04, "epsilon": 0.2, "epsilon_high": 0.28,
        "loss_type": "dr_grpo", "scale_rewards": "none", "num_iterations": 2, "max_steps": 10, "top_k": None,
        "logging_steps": 5, "lr_scheduler_type": "cosine", "vllm_model_impl": "transformers",
        "mask_truncated_completions": True, "min_p": 0.05, "repetition_penalty": 1.1, "top_entropy_quantile": 0.2,
    })
    assert raw["learner"]["lr"] == 3e-6 and raw["learner"]["epochs"] == 2
    assert raw["generation"]["n_samples_per_prompt"] == 4 and raw["generation"]["max_new_tokens"] == 64
    assert raw["generation"]["top_k"] == 0 and raw["vllm"]["model_impl"] == "transformers"
    # 8 per device x 4 steps per generation = 32 completions = 8 prompts; 8 x 2 per optimizer step
    assert raw["train"]["prompts_per_step"] == 8
    assert raw["learner"]["mini_batch_size"] == 16 and raw["learner"]["micro_batch_size"] == 8
    # 10 optimizer steps, 2 iterations x (4 / 2) updates per rollout -> 3 rollouts
    assert raw["train"]["steps"] == 3
    # TRL's use_bias_correction_kl, on by default in the releases CI runs (off in earlier ones): the KL times the ratio
    ratio = {"ratio": "token"} if trl_defaults("grpo")["use_bias_correction_kl"] else {}
    assert raw["algo"]["kl"] == {"coef": 0.04, "estimator": "k3", **ratio}
    assert raw["algo"]["policy_loss"]["clip_low"] == 0.2 and raw["algo"]["policy_loss"]["clip_high"] == 0.28
    assert raw["algo"]["policy_loss"]["aggregation"] == "seq-mean-token-sum-norm"
    assert raw["algo"]["policy_loss"]["mask_truncated"] is True
    assert raw["generation"]["min_p"] == 0.05 and raw["generation"]["repetition_penalty"] == 1.1
    assert raw["algo"]["policy_loss"]["top_entropy_quantile"] == 0.2
    assert raw["algo"]["advantage"]["estimator"] == "dr_grpo"
    # the optimizer and schedule run as TRL's Trainer would run them
    assert raw["learner"]["lr_scheduler"] == "cosine" and raw["learner"]["optimizer"] == "adamw"
    assert raw["learner"]["betas"] == [0.9, 0.999] and raw["learner"]["eps"] == 1e-8
    assert notes == ["max_steps 10 is 2.5 rollouts of 4 updates; the run makes 3 whole rollouts, 12 updates (its "
                     "schedule over them)",
                     "TRL fields logging_steps are trainer bookkeeping (logging, saving, evaluation, devices) "
                     "that rlhf-plugins does its own way; ignored"]


@pytest.mark.parametrize("fields, ours, note", [
    ({"save_steps": 50}, {"train.save_every": 50}, None),
    ({"save_strategy": "no"}, {"train.save_every": 0}, None),  # the trained policy is still saved at the end
    ({"save_steps": 0.25, "max_steps": 100, "num_iterations": 2}, {"train.save_every": 12},
     "save_steps 25 is 12.5 rollouts of 2 updates; every 12 here (after a whole rollout)"),
    ({"save_steps": 0.5}, {}, "save_steps 0.5 is a fraction of max_steps, which this config does not set; ignored"),
    ({"save_strategy": "best"}, {}, "save_strategy 'best' is not converted: checkpoints come every "
                                    "--train.save_every steps (the best policy by a metric: --train.best_metric)"),
    ({"save_total_limit": 3}, {"train.keep_checkpoints": 3}, None),
    ({"eval_strategy": "steps", "eval_steps": 8, "num_iterations": 2}, {"eval.every": 4}, None),
    ({"eval_strategy": "steps"}, {"eval.every": 10}, None),  # eval_steps defaults to logging_steps, as in TRL
    ({"eval_strategy": "epoch"}, {}, "eval_strategy 'epoch' is not converted: the held-out set is evaluated before "
                                     "the first step, after the last and every --eval.every steps"),
    ({"eval_steps": 5}, {}, "eval_steps is unused with eval_strategy 'no' (as in TRL)"),
    ({"save_steps": 500, "save_strategy": "steps"}, {}, None),  # TRL's defaults, spelled out: ours stay
])
def test_trl_checkpoint_and_evaluation_cadence_counts_updates(fields, ours, note):
    """TRL's save / eval steps are optimizer updates: whole rollouts here, set only where the config sets them
    (TRL's defaults -- 500-step checkpoints, all kept, no evaluation -- leave ours)."""
    raw, notes = from_grpo_fields(fields)
    for dotted, value in ours.items():
        section, key = dotted.split(".")
        assert raw[section][key] == value, (dotted, raw[section])
    assert "save_every" not in raw["train"] or "train.save_every" in ours
    assert "keep_checkpoints" not in raw["train"] or "train.keep_checkpoints" in ours
    assert "eval" not in raw or "eval.every" in ours
    cadence = [n for n in notes if "bookkeeping" not in n and not n.startswith("max_steps")]
    assert cadence == ([note] if note else [])


def test_transformers_new_checkpointing_names_convert_as_the_old_ones():
    """transformers 5.25 renamed gradient_checkpointing[_kwargs] activation_checkpointing[_kwargs], the old names
    kept as aliases that mirror the new: a config holding the new name (a YAML, or a GRPOConfig whose fields
    both names mirror) converts as the old one, the new name winning where both are set, as transformers reads
    them; TRL's default (checkpointing on) stands where neither is set."""
    def checkpointing(fields):
        return from_grpo_fields(fields)[0]["learner"]["gradient_checkpointing"]

    assert checkpointing({}) is True  # GRPOConfig's default
    assert checkpointing({"activation_checkpointing": False}) is False
    assert checkpointing({"activation_checkpointing": None, "gradient_checkpointing": False}) is False
    assert checkpointing({"gradient_checkpointing": True, "activation_checkpointing": False}) is False
    assert checkpointing({"gradient_checkpointing": True, "activation_checkpointing": True}) is True
    raw, notes = from_grpo_fields({"activation_checkpointing_kwargs": {"every_n_layers": 2}})
    assert notes == ["TRL field 'gradient_checkpointing_kwargs' is ignored: checkpointing always runs non-reentrant, "
                     "every decoder layer, its saved tensors on the device (--learner.gradient_checkpointing)"]


def test_trl_defaults_keep_trls_linear_decay_and_warmup():
    raw, notes = from_grpo_fields({"warmup_steps": 0.1, "optim": "sgd", "adam_beta1": 0.8})
    assert raw["learner"]["lr_scheduler"] == "linear" and raw["learner"]["warmup_ratio"] == 0.1
    assert raw["learner"]["optimizer"] == "sgd" and raw["learner"]["betas"][0] == 0.8
    raw, notes = from_grpo_fields({"gradient_checkpointing_kwargs": {"use_reentrant": True}, "pad_to_multiple_of": 8,
                                   "label_smoothing_factor": 0.1})
    assert notes == ["TRL field 'gradient_checkpointing_kwargs' is ignored: checkpointing always runs non-reentrant, "
                     "every decoder layer, its saved tensors on the device (--learner.gradient_checkpointing)",
                     "TRL field 'label_smoothing_factor' is ignored: it smooths the Trainer's language-modelling "
                     "loss, which TRL's GRPO loss replaces"]
    assert raw["learner"]["pad_to_multiple_of"] == 8  # TRL pads prompts and completions to it, as we do
    # GRPOTrainer's compute_loss ignores the num_items_in_batch this field counts (TRL 1.16): a note, not an error
    assert from_grpo_fields({"average_tokens_across_devices": False})[1] == [
        "TRL field 'average_tokens_across_devices' is ignored: it sets how the Trainer counts num_items_in_batch, "
        "which TRL's GRPO loss does not read (its loss_type sets the normalization; ours is "
        "--algo.policy_loss.aggregation)"]
    for value, ours in (("auto", 0), (None, 1), ("none", 1), ("16", 16)):  # TRL's default; no padding; CLI text
        assert from_grpo_fields({"pad_to_multiple_of": value})[0]["learner"]["pad_to_multiple_of"] == ours
    with pytest.raises(ConfigError, match=re.escape("TRL field 'pad_to_multiple_of' expects 'auto', None or a "
                                                    "number >= 1; got 0")):
        from_grpo_fields({"pad_to_multiple_of": 0})
    raw, _ = from_grpo_fields({"delta": 1.5, "epsilon_high": 0.28})
    assert raw["algo"]["policy_loss"]["dual_clip"] == 1.5 and raw["algo"]["policy_loss"]["clip_high"] == 0.28
    raw, notes = from_grpo_fields({"optim": "paged_adamw_8bit"})  # AdamW's update, its states stored otherwise
    assert raw["learner"]["optimizer"] == "adamw" and any("'paged_adamw_8bit' runs as torch's AdamW" in n
                                                           for n in notes)
    raw, notes = from_grpo_fields({"delta": 1.5, "loss_type": "sapo"})  # TRL ignores delta there
    assert "dual_clip" not in raw["algo"]["policy_loss"] and any("'delta' is ignored under loss_type 'sapo'" in n
                                                                  for n in notes)
    for field, value, message in (("delta", 0.9, "TRL delta 0.9 caps the ratio of every positive advantage below 1"),
                                  ("optim", "lion_32bit", "TRL optim 'lion_32bit' has no equivalent"),
                                  ("lr_scheduler_type", "polynomial", "TRL lr_scheduler_type 'polynomial'"),
                                  ("neftune_noise_alpha", 5.0, "TRL field 'neftune_noise_alpha' (5.0) changes training")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            from_grpo_fields({field: value})


@pytest.mark.parametrize("optim, text", [("sgd", "momentum=0.9, weight_decay=0.3"), ("sgd", ""),
                                         ("adamw_torch", "momentum=0.9"), ("adafactor", "beta1=0.5")])
def test_trl_optim_args_reach_the_optimizer_as_trls_trainer_hands_them(optim, text, tmp_path):
    """``optim_args`` as transformers' Trainer reads it (its own get_optimizer_cls_and_kwargs on TRL's
    GRPOConfig): SGD's momentum reaches the torch learner's SGD; what the Trainer passes to no optimizer (AdamW's
    and Adafactor's, SGD's weight_decay, which its param groups set) is a note."""
    import torch
    from transformers import Trainer
    from trl import GRPOConfig

    from rlhf_plugins.api import prepare
    from rlhf_plugins.learners.optimizer import make_optimizer

    args = GRPOConfig(output_dir=str(tmp_path), optim=optim, optim_args=text or None, report_to=[], use_cpu=True, bf16=False)
    _, theirs = Trainer.get_optimizer_cls_and_kwargs(args)
    raw, notes = from_grpo_fields({"optim": optim, "optim_args": text or None})
    config = prepare(raw, autoload=False)[0]
    ours = make_optimizer([torch.nn.Parameter(torch.zeros(2))], config.learner, 0.1).defaults
    assert ours.get("momentum", 0.0) == theirs.get("momentum", 0.0) == (0.9 if text.startswith("momentum") and optim == "sgd" else 0.0)
    assert [n for n in notes if "optim_args" in n] == ([] if not text else [
        "TRL optim_args weight_decay ignored as TRL's Trainer ignores them for SGD (weight_decay: its param groups "
        "set it from weight_decay)"] if optim == "sgd" else [
        f"TRL optim_args '{text}' is ignored: TRL's Trainer does not pass it to optim '{optim}'"])
    if "weight_decay" in text:  # the Trainer's param groups set it (from weight_decay), over SGD's default
        from transformers import AutoModelForCausalLM

        from rlhf_plugins.testing import tiny_model_path

        trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_path()), args=args)
        assert theirs["weight_decay"] == 0.3 and {g["weight_decay"] for g in trainer.create_optimizer().param_groups} == {0.0}
    assert from_grpo_fields({"optim": optim, "optim_target_modules": ["q_proj"]})[1][-1] == (
        "TRL field 'optim_target_modules' is ignored: TRL's Trainer reads it only for the GaLore and APOLLO "
        "optimizers, which have no equivalent here (their optim stops the conversion)")
    for bad, message in (("nesterov=true", "SGD's dampening and nesterov have no equivalent here"),
                         ("momentum", "is not key=value pairs separated by commas (at 'momentum')"),
                         ("momentum=fast", "momentum expects a number; got 'fast'")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            from_grpo_fields({"optim": "sgd", "optim_args": bad})


def test_generation_kwargs_override_the_sampling_fields_and_anything_else_is_one_error():
    """TRL hands generation_kwargs to vLLM's SamplingParams or transformers' GenerationConfig over its own
    sampling fields: the keys we have land on generation.* (vLLM's top_k -1: none); others would change
    what is sampled and stop the conversion naming them."""
    raw, notes = from_grpo_fields({"temperature": 1.0, "max_completion_length": 32, "generation_kwargs": {
        "temperature": 0.7, "top_k": -1, "min_p": 0.05, "max_tokens": 64, "do_sample": True}})
    assert notes == [] and raw["generation"]["temperature"] == 0.7 and raw["generation"]["top_k"] == 0
    assert raw["generation"]["min_p"] == 0.05 and raw["generation"]["max_new_tokens"] == 64
    raw, _ = from_grpo_fields({"generation_kwargs": '{"max_new_tokens": 48, "top_k": 20}'})  # JSON from a command line
    assert raw["generation"]["max_new_tokens"] == 48 and raw["generation"]["top_k"] == 20
    raw, _ = from_grpo_fields({"generation_kwargs": {"stop": ["</answer>", "\n\n"]}})  # vLLM's stop strings
    assert raw["generation"]["stop"] == ["</answer>", "\n\n"]
    raw, _ = from_grpo_fields({"generation_kwargs": {"stop_strings": "</answer>"}})  # transformers' spelling
    assert raw["generation"]["stop"] == ["</answer>"]
    for kwargs, message in (({"num_beams": 2, "use_beam_search": True}, "TRL generation_kwargs: no equivalent in "
                             "rlhf-plugins for 'num_beams', 'use_beam_search'; it takes temperature, top_p, top_k"),
                            ({"stop": [3]}, "TRL generation_kwargs 'stop' expects a string or a list of strings"),
                            ({"do_sample": False}, "TRL generation_kwargs do_sample false: GRPO samples"),
                            ({"top_p": "high"}, "TRL generation_kwargs 'top_p' expects float; got 'high'")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            from_grpo_fields({"generation_kwargs": kwargs})


def test_fields_of_earlier_trl_releases_convert_with_a_note():
    """A YAML file of TRL 0.x / transformers 4 holds max_prompt_length and warmup_ratio, which TRL 1.x's
    GRPOConfig lacks: they still land on our keys, each with a note of what differs."""
    raw, notes = from_grpo_fields({"max_prompt_length": 512, "warmup_ratio": 0.1, "lr_scheduler_type": "cosine"})
    assert raw["data"]["max_prompt_tokens"] == 512 and raw["learner"]["warmup_ratio"] == 0.1
    assert raw["learner"]["lr_scheduler"] == "cosine"
    assert notes == ["TRL 0.x's max_prompt_length (gone from TRL 1.x) becomes --data.max_prompt_tokens: longer "
                     "prompts are dropped with a warning, where TRL 0.x cut them from the left",
                     "transformers 4's warmup_ratio (transformers 5 reads a warmup_steps below 1 as the ratio) "
                     "becomes --learner.warmup_ratio"]
    raw, notes = from_grpo_fields({"max_prompt_length": None})
    assert "max_prompt_tokens" not in raw["data"]
    assert notes == ["TRL field 'max_prompt_length' (null) is ignored: --data.max_prompt_tokens keeps its default"]
    with pytest.raises(ConfigError, match=re.escape("TRL field 'max_prompt_length' expects int; got 'long'")):
        from_grpo_fields({"max_prompt_length": "long"})


def test_model_init_kwargs_and_the_sampler_carry_over_and_speed_knobs_are_notes():
    """from_pretrained's dtype and trust_remote_code (and TRL's own trust_remote_code) become ours (bf16 still
    wins, as TRL's autocast would); attention and device placement are notes; anything else in it, an unknown
    dtype or a sampler we do not have is one error naming it."""
    raw, notes = from_grpo_fields({"model_init_kwargs": {"dtype": "float16", "attn_implementation": "sdpa",
                                                         "trust_remote_code": True}})
    assert raw["model"] == {"dtype": "float16", "trust_remote_code": True, "fp32_lm_head": False}
    assert notes == ["TRL model_init_kwargs 'attn_implementation' is ignored: this package's attention (SDPA with "
                     "its own masks and KV caches) runs"]
    raw, _ = from_grpo_fields({"model_init_kwargs": {"torch_dtype": "float32"}, "bf16": True})
    assert raw["model"]["dtype"] == "bfloat16" and "trust_remote_code" not in raw["model"]
    raw, notes = from_grpo_fields({"trust_remote_code": True})  # TRL 1.x's own field: the model's and reward models'
    assert raw["model"]["trust_remote_code"] is True and not any("trust_remote_code" in n for n in notes)
    raw, notes = from_grpo_fields({"model_init_kwargs": {"torch_dtype": "auto"}, "train_sampling_strategy": "sequential",
                                   "enable_jit_checkpoint": True, "use_transformers_continuous_batching": True})
    assert "dtype" not in raw.get("model", {}) and raw["data"]["shuffle"] is False
    assert notes == [
        "TRL field 'enable_jit_checkpoint' is ignored: a SIGTERM or SIGINT always finishes the step and writes a "
        "checkpoint",
        "TRL field 'use_transformers_continuous_batching' is ignored: the transformers engine decodes the whole "
        "rollout in fixed-shape steps (CUDA graphs on GPUs); vLLM with use_vllm"]
    assert from_grpo_fields({})[0]["data"]["shuffle"] is True
    for fields, message in (({"model_init_kwargs": {"revision": "main"}},
                             "TRL model_init_kwargs: no equivalent in rlhf-plugins for 'revision'; remove them"),
                            ({"model_init_kwargs": {"dtype": "int8"}},
                             "TRL model_init_kwargs dtype 'int8' has no equivalent; choose one of: float32, bfloat16"),
                            ({"train_sampling_strategy": "group_by_length"},
                             "TRL train_sampling_strategy 'group_by_length' has no equivalent; use random or sequential")):
        with pytest.raises(ConfigError, match=message):
            from_grpo_fields(fields)


def test_the_schedule_warms_up_and_decays_as_configured():
    from types import SimpleNamespace

    from rlhf_plugins.learners.base import lr_factor

    cfg = SimpleNamespace(warmup_steps=2, warmup_ratio=0.0, lr_scheduler="linear", min_lr_ratio=0.0)
    assert [round(lr_factor(u, cfg, 10), 4) for u in range(10)] == [0.3333, 0.6667, 1.0, 0.875, 0.75, 0.625, 0.5,
                                                                      0.375, 0.25, 0.125]
    # as transformers' schedules: the decay ends after the last update
    cfg = SimpleNamespace(warmup_steps=0, warmup_ratio=0.0, lr_scheduler="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, cfg, 10) == pytest.approx(1.0) and lr_factor(10, cfg, 10) == pytest.approx(0.1)
    assert lr_factor(5, cfg, 10) == pytest.approx(0.1 + 0.9 * 0.5)
    cfg = SimpleNamespace(warmup_steps=0, warmup_ratio=0.5, lr_scheduler="constant", min_lr_ratio=0.0)
    assert lr_factor(4, cfg, 10) == pytest.approx(5 / 6) and lr_factor(5, cfg, 10) == 1.0


def test_grpo_field_errors():
    with pytest.raises(ConfigError, match="TRL field 'neftune_noise_alpha' \\(5.0\\) changes training and has no "
                                          "equivalent"):
        from_grpo_fields({"neftune_noise_alpha": 5.0})
    with pytest.raises(ConfigError, match="'num_generation' is not a field of trl.GRPOConfig; did you mean 'num_generations'"):
        from_grpo_fields({"num_generation": 4})
    with pytest.raises(ConfigError, match="TRL loss_type 'opo' has no equivalent"):
        from_grpo_fields({"loss_type": "opo"})
    raw, _ = from_grpo_fields({"importance_sampling_level": "sequence", "use_vllm": True,
                               "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_cap": 3.0})
    assert raw["algo"]["policy_loss"]["name"] == "gspo"
    assert raw["generation"]["backend"] == "vllm"
    assert raw["algo"]["policy_loss"]["mismatch"] == "tis" and raw["algo"]["policy_loss"]["mismatch_high"] == 3.0


def test_trl_yaml_from_the_command_line(rlhf, tmp_path):
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(textwrap.dedent("""
        def correct(prompts, completions, label, **kwargs):
            return [1.0 if c.strip() == l else 0.0 for c, l in zip(completions, label)]
        def unused(prompts, completions, **kwargs):
            return [0.0] * len(completions)
    """))
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(yaml.safe_dump({
        "reward_funcs": [f"{rewards.with_suffix('')}.correct".replace(str(tmp_path) + "/", "")],
        "learning_rate": 1e-3, "num_generations": 4, "per_device_train_batch_size": 16, "max_completion_length": 6,
        "max_steps": 2, "gradient_checkpointing": False, "logging_steps": 1,
    }))
    # the reward module sits in the working directory: imported from there, as `trl grpo` would
    code, out, err = rlhf("train", "--trl-config", str(cfg), "--train.progress", "false")
    assert code == 0, err
    assert "TRL fields logging_steps are trainer bookkeeping" in err
    saved = yaml.safe_load((the_run() / "config.yaml").read_text())
    assert saved["reward"]["functions"] == ["correct"]
    assert saved["generation"]["n_samples_per_prompt"] == 4 and saved["train"]["prompts_per_step"] == 4
    assert saved["train"]["steps"] == 2 and saved["learner"]["lr"] == 1e-3


def test_rlhf_convert_trl_writes_the_config_trl_config_runs(rlhf, tmp_path):
    """`rlhf convert trl grpo.yaml -o ours.yaml`: our YAML with the conversion's notes as comments and the
    reward module as a plugin; it resolves to the config `--trl-config` runs, and `rlhf train --config` takes it."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.config.loading import load_yaml
    from rlhf_plugins.integrations.trl_config import from_trl_yaml

    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def correct(prompts, completions, label, **kwargs):
            return [1.0 if c.strip() == l else 0.0 for c, l in zip(completions, label)]
    """))
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump({
        "reward_funcs": ["my_rewards.correct"], "learning_rate": 1e-3, "num_generations": 4,
        "per_device_train_batch_size": 16, "max_completion_length": 6, "max_steps": 2, "logging_steps": 1,
        "num_iterations": 2, "save_steps": 3}))
    for argv, line in [(["convert", "trl"], "give one TRL YAML file, and rloo before it for a trl rloo config, "
                                                 "e.g. rlhf convert trl grpo.yaml"),
                       (["convert", "trl", "gone.yaml"], "config file 'gone.yaml' does not exist")]:
        check_one_line_error(*rlhf(*argv)[::2], line)
    code, out, err = rlhf("convert", "trl", "-o", "ours.yaml", "grpo.yaml")
    assert code == 0, err
    text = (tmp_path / "ours.yaml").read_text()
    assert text.startswith("# rlhf train --config this.yaml   (converted from the TRL GRPO config grpo.yaml")
    assert "# note: save_steps 3 is 1.5 rollouts of 2 updates; every 2 here (after a whole rollout)" in text
    assert "# note: TRL fields logging_steps are trainer bookkeeping" in text
    ours = load_yaml(tmp_path / "ours.yaml")
    assert ours["plugins"] == ["my_rewards"] and ours["train"]["save_every"] == 2
    raw, _, plugins = from_trl_yaml(tmp_path / "grpo.yaml")
    assert prepare(ours, autoload=False)[0].to_dict() == prepare(raw, plugins, autoload=False)[0].to_dict()
    code, _, err = rlhf("train", "--config", "ours.yaml", "--dry-run")
    assert code == 0, err


def test_rlhf_convert_trl_reads_trls_flags_over_its_config_file_or_alone(rlhf, tmp_path):
    """TRL's own command line, ``trl grpo [--config FILE] --field value ...``: each flag typed by TRL's parser (a
    bare boolean flag true, a list the words after it, a dict as JSON) and over the file's field, as TrlParser
    lets it -- the config written is the one of a YAML holding the same fields; a flag TRL lacks or a value of
    the wrong type is one line, and no file is written."""
    from rlhf_plugins.config.loading import load_yaml
    from rlhf_plugins.integrations.trl_config import from_trl_yaml

    base = {"reward_funcs": ["my_rewards.correct"], "learning_rate": 1e-3, "num_generations": 4,
            "per_device_train_batch_size": 16, "max_completion_length": 6}
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(base))
    flags = ["--learning_rate", "2e-3", "--use_vllm", "--reward_funcs", "my_rewards.correct", "my_rewards.short",
             "--model_init_kwargs", '{"dtype": "bfloat16"}', "--gradient_checkpointing", "false"]
    given = {"learning_rate": 2e-3, "use_vllm": True, "reward_funcs": ["my_rewards.correct", "my_rewards.short"],
             "model_init_kwargs": {"dtype": "bfloat16"}, "gradient_checkpointing": False}
    for name, fields in (("over", {**base, **given}), ("alone", given)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(fields))
        config = ["--config", "grpo.yaml"] if name == "over" else []
        code, _, err = rlhf("convert", "trl", "-o", f"ours-{name}.yaml", "--", "trl", "grpo", *config, *flags)
        assert code == 0, err
        text = (tmp_path / f"ours-{name}.yaml").read_text()
        assert text.startswith("# rlhf train --config this.yaml   (converted from the TRL GRPO command line (trl grpo"
                               + (" --config grpo.yaml" if config else "") + " and 5 flags)")
        raw, _, plugins = from_trl_yaml(tmp_path / f"{name}.yaml")
        assert load_yaml(tmp_path / f"ours-{name}.yaml") == {**raw, "plugins": plugins}
        assert raw["learner"]["lr"] == 2e-3 and raw["generation"]["backend"] == "vllm"
        assert raw["model"]["dtype"] == "bfloat16" and raw["learner"]["gradient_checkpointing"] is False
        assert raw["reward"]["functions"] == ["correct", "short"]
    assert load_yaml(tmp_path / "ours-over.yaml")["generation"]["n_samples_per_prompt"] == 4  # the file's
    for bad, line in ((["--learning_rate", "fast"], "trl grpo: argument --learning_rate/--learning-rate: invalid "
                                                    "float value: 'fast'"),
                      (["--learnig_rate", "1e-6"], "trl grpo takes no --learnig_rate 1e-6 (not a field of its script"),
                      (["--config"], "trl's --config needs a file name")):
        check_one_line_error(*rlhf("convert", "trl", "-o", "bad.yaml", "--", "trl", "grpo", *bad)[::2], line)
        assert not (tmp_path / "bad.yaml").exists()


def test_trl_field_with_no_equivalent_is_one_line(rlhf, tmp_path):
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text("neftune_noise_alpha: 5.0\n")
    code, _, err = rlhf("train", "--trl-config", str(cfg))
    assert code == 2 and err.strip().count("\n") == 0
    assert "TRL field 'neftune_noise_alpha' (5.0) changes training and has no equivalent" in err


def test_trl_float32_head_becomes_ours():
    raw, _ = from_grpo_fields({"cast_lm_head_to_fp32": True})
    assert raw["model"]["fp32_lm_head"] is True
    raw, _ = from_grpo_fields({"learning_rate": 1e-5})
    assert raw["model"]["fp32_lm_head"] is False  # TRL's default


def test_openrlhf_reward_file_unchanged(rlhf, tmp_path):
    path = tmp_path / "orm.py"
    path.write_text(textwrap.dedent("""
        import torch
        def reward_func(queries, prompts, labels):
            assert all(q.startswith(p) for q, p in zip(queries, prompts))
            return torch.tensor([1.0 if q[len(p):].strip() == l else 0.0 for q, p, l in zip(queries, prompts, labels)])
    """))
    code, _, err = rlhf("train", "--plugin", str(path), "--data.apply_chat_template", "false", *short_run())
    assert code == 0, err
    assert yaml.safe_load((the_run() / "config.yaml").read_text())["reward"]["functions"] == ["reward_func"]


def test_an_openrlhf_reward_func_without_a_label_column_gets_empty_labels_as_in_openrlhf():
    """OpenRLHF hands ``""`` as the label of a row when there is no --label_key; a file that zips the
    labels must not get None."""
    from rlhf_plugins.rewards.callables import wrap_reward

    seen = []

    def reward_func(queries, prompts, labels):
        seen.append(list(labels))
        return {"rewards": [float(len(q)) for q, _, _ in zip(queries, prompts, labels)]}

    out = wrap_reward(reward_func)(prompts=["a", "b"], completions=["x", "yz"])
    assert seen == [["", ""]] and out == {"rewards": [2.0, 3.0], "scores": None}


def test_an_openrlhf_reward_func_reads_rendered_prompts_and_queries_and_logs_its_extra_logs(rlhf, tmp_path,
                                                                                             tiny_model):
    """As OpenRLHF calls it: ``prompts`` as the policy saw them (chat template applied to the messages),
    ``queries`` the prompt and completion tokens decoded together (special tokens kept); the returned
    ``extra_logs`` become metrics."""
    from transformers import AutoTokenizer

    seen = tmp_path / "seen.jsonl"
    (tmp_path / "orm.py").write_text(textwrap.dedent(f"""
        import json, torch
        def reward_func(queries, prompts, labels):
            with open({str(seen)!r}, "a") as f:
                for q, p, l in zip(queries, prompts, labels):
                    f.write(json.dumps({{"q": q, "p": p, "l": l}}) + "\\n")
            right = torch.tensor([1.0 if l in q[len(p):] else 0.0 for q, p, l in zip(queries, prompts, labels)])
            return {{"rewards": right, "scores": right, "extra_logs": {{"seen_twice": torch.full_like(right, 2.0)}}}}
    """))
    rows = [{"problem": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
            for a in range(4) for b in range(4)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = rlhf("train", "--plugin", "orm.py", "--data.path", "chat.jsonl", "--data.prompt_key", "problem",
                        "--data.label_key", "answer", "--data.apply_chat_template", "true", *short_run())
    assert code == 0, err
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rendered = {r["answer"]: tok.apply_chat_template(r["problem"], add_generation_prompt=True, tokenize=False)
                for r in rows if r["answer"] in ("0", "6")}  # answers 1-5 have several rows; these one each
    calls = [json.loads(x) for x in seen.read_text().splitlines()]
    assert len(calls) == 3 * 4 * 4
    for call in calls:
        assert call["p"].startswith(tok.bos_token) and call["p"].endswith("<|assistant|>")
        assert call["q"].startswith(call["p"]) and call["l"] in {r["answer"] for r in rows}
        if call["l"] in rendered:
            assert call["p"] == rendered[call["l"]]
    assert any(c["q"].endswith(tok.eos_token) for c in calls)  # special tokens kept, as OpenRLHF decodes
    assert [r["seen_twice"] for r in metrics_of(the_run())] == [2.0, 2.0, 2.0]


def test_from_trl_doc_runs_on_ray(tmp_path):
    """docs/from_trl.md, as written: a TRL script on a local Ray cluster."""
    doc = (ROOT / "docs" / "from_trl.md").read_text()
    script = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "train_grpo.py").write_text(script)
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "train_grpo.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = the_run(tmp_path / "runs" / "trl-on-ray")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["placement"]["strategy"] == "ray" and saved["reward"]["functions"] == ["correct", "brief"]
    assert saved["reward"]["weights"] == [1.0, 0.5] and saved["algo"]["policy_loss"]["clip_high"] == 0.28
    rows = metrics_of(run)
    assert {"reward/correct", "reward/brief"} <= set(rows[0])  # each function logged on its own


# --- PEFT ------------------------------------------------------------------------------------

def test_lora_trains_only_the_adapter_and_saves_it(rlhf):
    code, _, err = rlhf("train", "--lora.rank", "4", "--lora.target_modules", "q_proj,v_proj", "--learner.lr", "5e-3",
                        "--lora.save_merged", "true", "--sync.verify", "true", *short_run())
    assert code == 0, err
    run = the_run()
    cfg = json.loads((run / "final" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]
    from safetensors import safe_open

    with safe_open(str(run / "final" / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k for k in keys)
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(run / "final-merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())


def test_lora_on_the_critic_with_ppo(rlhf):
    """The critic's backbone carries LoRA too: its saved folder is an adapter, and it trained."""
    code, _, err = rlhf("train", "--lora.rank", "4", "--algo.advantage.estimator", "gae", *short_run())
    assert code == 0, err
    critic = the_run() / "critic"
    adapter = json.loads((critic / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and (critic / "value_head.safetensors").is_file()
    assert not (critic / "model.safetensors").exists()  # only the adapter, not a full backbone
    rows = metrics_of(the_run())
    assert all("critic/loss" in r for r in rows)


def test_lora_config_file(rlhf, tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["o_proj"], "lora_dropout": 0.0}))
    code, _, err = rlhf("train", "--lora.config", str(tmp_path), *short_run())
    assert code == 0, err
    assert json.loads((the_run() / "final" / "adapter_config.json").read_text())["target_modules"] == ["o_proj"]
    assert "adapter weights" not in err
    # a trained adapter's folder (its saved config says inference_mode: true): the config is read, the adapter
    # trains, and a line says its weights are not read
    trained = the_run() / "final"
    code, _, err = rlhf("train", "--lora.config", str(trained), "--learner.lr", "1e-2",
                        *short_run("--train.run_name", "again"))
    assert code == 0, err
    assert (f"lora.config '{trained}' holds adapter weights too; only its config is read: the adapter starts as "
            "PEFT initialises it") in err
    assert metrics_of(Path("runs") / "again")[-1]["grad_norm"] > 0


@pytest.mark.parametrize("engine, sync", [("transformers", []), ("vllm", ["--sync.method", "adapter"])])
def test_a_trained_adapter_goes_on_training_from_its_weights_with_the_engine_in_step(rlhf, engine, sync):
    """--lora.adapter FOLDER (a LoRA run's final/) starts the policy from the adapter's trained weights -- at the
    first step it is already away from the base, its reference (KL > 0, which a fresh adapter has at 0) -- and
    the engine samples from it from the first rollout on (it gets the weights at the start: without, its
    log-probs were the base's, 0.2 away), merged or as vLLM's LoRA."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    code, _, err = rlhf("train", "--lora.rank", "4", "--learner.lr", "1e-2", *short_run("--train.run_name", "first"))
    assert code == 0, err
    trained = Path("runs") / "first" / "final"
    code, _, err = rlhf("train", "--lora.adapter", str(trained), "--generation.backend", engine, *sync,
                        *short_run("--train.steps", "1", "--train.run_name", "again"))
    assert code == 0, err
    row = metrics_of(Path("runs") / "again")[0]
    assert row["kl"] > 0.01 and row["mismatch/abs_log_ratio"] < 1e-4, row
    assert json.loads((Path("runs") / "again" / "final" / "adapter_config.json").read_text())["r"] == 4


def test_a_trained_adapter_that_does_not_fit_the_model_is_one_line(rlhf, tmp_path):
    """An adapter trained on another model (here a wider one) given as --lora.adapter: one line naming it and
    the way out, no run."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.helpers import random_llama

    wide = random_llama(tmp_path / "wide", hidden_size=96)
    other = tmp_path / "other-adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(wide), LoraConfig(r=4, target_modules=["q_proj"])
                   ).save_pretrained(str(other))
    code, _, err = rlhf("train", "--lora.adapter", str(other), *short_run())
    check_one_line_error(code, err, f"lora.adapter '{other}' does not fit the model of --model.path (")
    assert err.strip().endswith("); give the base model it was trained on")


def test_lora_targets_that_match_nothing_list_the_modules(rlhf):
    code, _, err = rlhf("train", "--lora.rank", "4", "--lora.target_modules", "attn_qkv", *short_run())
    assert code == 2
    assert "LoRA target modules ['attn_qkv'] match nothing in the actor model; available: " \
           "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in err
    assert not Path("runs").exists() or not any(Path("runs").iterdir())


def test_lora_on_gpt2s_conv1d_layers_trains_in_parity_and_its_targets_are_listed(rlhf, tmp_path, recwarn):
    """GPT-2's linear layers are transformers' Conv1D: a LoRA on them trains with the engine's log-probs the
    learner's (its merged weights folded in x out), and targets that match nothing list them. GPT-2 ties its
    output head to its input embeddings, one tensor in the engine: a LoRA on either is refused under merged
    weights (the engine sampled from another policy) and trains in parity with adapter sync."""
    from tests.helpers import gpt2_model_path

    reward = tmp_path / "mean_token_id.py"  # tells a random model's samples apart, so that the adapter moves
    reward.write_text("def mean_token_id(prompts, completions, completion_ids, **kwargs):\n"
                      "    return [sum(ids) / len(ids) / 500 for ids in completion_ids]\n")
    model = ["--model.path", gpt2_model_path(), "--plugin", str(reward), "--lora.rank", "8", "--learner.lr", "1e-2"]
    code, _, err = rlhf("train", *model, "--lora.target_modules", "q_proj", *short_run())
    check_one_line_error(code, err, "LoRA target modules ['q_proj'] match nothing in the actor model; available: "
                                    "c_attn, c_fc, c_proj, lm_head")
    for targets, name in (("c_attn,lm_head", "lm_head"), ("wte", "transformer.wte")):
        code, _, err = rlhf("train", *model, "--lora.target_modules", targets, *short_run())
        check_one_line_error(code, err, "the model's input embeddings and output head share one weight "
                                        f"(tie_word_embeddings), and the LoRA config adapts {name}, which merged "
                                        f"weights cannot give the engine; leave {name.rsplit('.', 1)[-1]} out of "
                                        "the LoRA config, or use --sync.method adapter")
    assert no_run_dirs()
    for run, extra in (("conv1d", []), ("head", ["--lora.target_modules", "c_attn,lm_head", "--sync.method", "adapter"])):
        code, _, err = rlhf("train", *model, *extra, *short_run("--train.run_name", run))
        assert code == 0, err
        rows = metrics_of(Path("runs") / run)
        assert rows[-1]["grad_norm"] > 0 and all(r["mismatch/abs_log_ratio"] < 1e-4 for r in rows), run
    noted = [str(w.message) for w in recwarn if "fan_in_fan_out" in str(w.message) or "tie_word" in str(w.message)]
    assert not noted  # PEFT's per-layer notes on what is handled here, kept quiet


_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def _merged_as_it_streams(model) -> tuple[dict, int]:
    """The merged export of ``model``'s state dict, and the most tensors it took in before giving one out
    (what it held at once: a LoRA module's tensors, not the model's)."""
    from rlhf_plugins.models.lora import export_weights

    held, most = 0, 0

    def source():
        nonlocal held
        for name, tensor in model.state_dict().items():
            held += 1
            yield name, tensor.detach().clone()

    got = {}
    for name, tensor in export_weights(model, source()):
        most, held = max(most, held), 0
        got[name] = tensor
    return got, most


@pytest.mark.parametrize("model_type, sizes, lora", [
    ("llama", _LLAMA, dict(target_modules="all-linear")),
    # GPT-2's Conv1D stores weights in x out (PEFT's fan_in_fan_out): a wrongly oriented B @ A fits its square c_proj
    ("gpt2", dict(n_embd=32, n_layer=1, n_head=2), dict(target_modules="all-linear")),
    ("llama", _LLAMA, dict(target_modules="all-linear", use_dora=True)),
    ("llama", _LLAMA, dict(target_modules="all-linear", use_rslora=True, rank_pattern={"q_proj": 2},
                           alpha_pattern={"v_proj": 64})),
    ("llama", _LLAMA, dict(target_modules=["q_proj", "embed_tokens"], modules_to_save=["lm_head"])),
    ("llama", _LLAMA, dict(target_modules=["q_proj", "embed_tokens"], use_dora=True)),
    ("llama", {**_LLAMA, "attention_bias": True}, dict(target_modules=["q_proj", "v_proj"], bias="all", lora_bias=True)),
], ids=["linear", "conv1d", "dora", "rslora-rank-and-alpha-patterns", "embedding-and-modules-to-save",
        "embedding-dora", "trained-biases"])
def test_the_merged_weights_an_engine_loads_are_pefts_own_merge(model_type, sizes, lora, recwarn):
    """W + s * B @ A under the base names, as PEFT's merge_and_unload gives them, tensor for tensor: each layer
    its own scale (rsLoRA, rank_pattern, alpha_pattern), Conv1D's and embeddings' orientation, DoRA's magnitudes,
    lora_bias, and PEFT's fully trained modules_to_save copies under the base names."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_plugins.api import prepare
    from rlhf_plugins.builtin_plugins.lora import apply_lora

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=64, **sizes))
    if model_type == "gpt2":  # the run's own wrapping, PEFT's per-layer Conv1D warning kept quiet
        config, _, _ = prepare({"lora": {"rank": 4}}, autoload=False)
        model = apply_lora(model, config, "actor")
        assert not [w for w in recwarn if "fan_in_fan_out" in str(w.message)]
    else:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **lora))
    with torch.no_grad():  # a trained adapter: B away from PEFT's zero, magnitudes, biases and copies moved
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    got, held = _merged_as_it_streams(model)
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(got) == set(want)
    assert held <= 6 < len(want)  # one module's base weight, bias, A, B, B's bias, magnitudes at most
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    base = {n.replace("base_model.model.", "").replace(".base_layer", ""): t
            for n, t in model.state_dict().items() if n.endswith(".base_layer.weight")}
    assert base and all((got[n] - t).abs().max() > 0.01 for n, t in base.items())  # every adapted layer moved


def test_a_lora_bias_on_a_layer_without_one_is_refused_before_training_unless_adapters_sync(rlhf, tmp_path):
    """PEFT's lora_bias cannot be merged into a layer without a bias (PEFT refuses to merge it too): one line
    at start, no run left; with adapter sync the engine applies it as PEFT does, and the run keeps parity."""
    from peft import LoraConfig

    LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_bias=True).save_pretrained(str(tmp_path / "lb"))
    code, _, err = rlhf("train", "--lora.config", str(tmp_path / "lb"), *short_run())
    check_one_line_error(code, err, "the LoRA of model.layers.0.self_attn.q_proj has a bias (lora_bias) and its "
                                    "layer has none, so it cannot be merged into an engine's weights; use "
                                    "--sync.method adapter or lora_bias false")
    assert no_run_dirs()
    code, _, err = rlhf("train", "--lora.config", str(tmp_path / "lb"), "--sync.method", "adapter",
                        "--learner.lr", "1e-2", *short_run())
    assert code == 0, err
    assert all(r["mismatch/abs_log_ratio"] < 1e-4 for r in metrics_of(the_run()))


def test_a_lora_on_the_embeddings_trains_in_parity_and_saves_the_adapter_alone(rlhf, tmp_path):
    """LoRA on embed_tokens: its merged embeddings reach the engine (log-probs the learner's while it moves),
    and final/ holds the adapter's tensors, not PEFT's whole copy of the embeddings it saves by default."""
    from peft import LoraConfig
    from safetensors import safe_open

    LoraConfig(r=8, target_modules=["q_proj", "embed_tokens"]).save_pretrained(str(tmp_path / "emb"))
    code, _, err = rlhf("train", "--lora.config", str(tmp_path / "emb"), "--learner.lr", "1e-2", *short_run())
    assert code == 0, err
    assert "save_embedding_layers" not in err
    rows = metrics_of(the_run())
    assert rows[-1]["grad_norm"] > 0 and all(r["mismatch/abs_log_ratio"] < 1e-4 for r in rows)
    with safe_open(str(the_run() / "final" / "adapter_model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert any("embed_tokens.lora_embedding_A" in n for n in names) and all(".lora_" in n for n in names)


def test_a_lora_variant_that_does_not_merge_is_named():
    """PEFT's aLoRA (its adapter active only after invocation tokens) has no merged form: named in one line."""
    import torch
    from peft import LoraConfig, get_peft_model

    needs_release_with("peft", LoraConfig, "alora_invocation_tokens")  # aLoRA came with PEFT 0.17
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_plugins.models.lora import adapted_layers
    from rlhf_plugins.models.weights import WeightSyncError

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=64, **_LLAMA))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], alora_invocation_tokens=[1, 2],
                                             task_type="CAUSAL_LM"))
    with pytest.raises(WeightSyncError, match=r"^the LoRA of model.layers.0.self_attn.q_proj is PEFT's "
                                              r"ALoraLinearVariant, which is not merged into an engine's weights "
                                              r"here; use a plain or DoRA LoRA config$"):
        adapted_layers(model)


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_a_dora_lora_with_its_own_ranks_and_a_trained_head_keeps_the_engine_in_parity(rlhf, tmp_path, mode):
    """A PEFT config beyond the plain fields (DoRA, a rank_pattern, lm_head fully trained as modules_to_save)
    reaches the engine whole by either sync: its log-probs stay the learner's while the adapter moves."""
    from peft import LoraConfig

    LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], use_dora=True,
               rank_pattern={"v_proj": 2}, modules_to_save=["lm_head"]).save_pretrained(str(tmp_path / "dora"))
    code, _, err = rlhf("train", "--lora.config", str(tmp_path / "dora"), "--learner.lr", "1e-2",
                        *(["--sync.method", "adapter"] if mode == "adapter" else []), *short_run())
    assert code == 0, err
    rows = metrics_of(the_run())
    assert rows[-1]["grad_norm"] > 0 and all(r["mismatch/abs_log_ratio"] < 1e-4 for r in rows)


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_lora_sync_modes_keep_parity_with_the_transformers_engine(rlhf, mode):
    code, _, err = rlhf("train", "--lora.rank", "8", *(["--sync.method", "adapter"] if mode == "adapter" else []), "--learner.lr", "5e-3",
                        "--sync.verify", "true", "--algo.policy_loss.mismatch", "tis", *short_run())
    assert code == 0, err
    rows = metrics_of(the_run())
    assert all(r["mismatch/abs_log_ratio"] < 1e-4 for r in rows)


@pytest.mark.integration
def test_lora_with_vllm_doc_commands(rlhf):
    """docs/lora_vllm.md, every command, shortened: both sync modes, then Ray + ZeRO-3 + adapters into vLLM."""
    pytest.importorskip("vllm")
    doc = (ROOT / "docs" / "lora_vllm.md").read_text()
    block = re.search(r"```bash\n(.*?)```", doc, re.S).group(1)
    commands = [line.split()[2:] for line in block.splitlines() if line.startswith("rlhf train")]
    assert len(commands) == 3
    for i, args in enumerate(commands):
        code, _, err = rlhf("train", *args, "--algo.policy_loss.mismatch", "tis",
                            *short_run("--train.run_name", f"doc{i}"))
        assert code == 0, err
        rows = metrics_of(Path("runs") / f"doc{i}")
        assert all(r["mismatch/abs_log_ratio"] < 1e-4 for r in rows), i
        assert (Path("runs") / f"doc{i}" / "final" / "adapter_config.json").is_file()
    assert (Path("runs") / "doc1" / "final-merged" / "config.json").is_file()


@pytest.mark.integration
def test_adapter_sync_into_a_vllm_engine_without_lora_is_refused(tiny_model):
    pytest.importorskip("vllm")
    from rlhf_plugins.api import prepare
    from rlhf_plugins.engines.vllm_engine import VLLMEngine
    from rlhf_plugins.errors import UsageError
    from rlhf_plugins.testing import backend_context

    config, pm, _ = prepare({"generation": {"backend": "vllm"}}, autoload=False)
    engine = VLLMEngine(backend_context(config, "generation", tiny_model, pm))
    try:
        with pytest.raises(UsageError, match="started without LoRA support"):
            engine.load_adapter({}, {"r": 8})
    finally:
        engine.shutdown()


def test_an_adapter_vllm_cannot_serve_is_refused_as_the_engine_starts(rlhf, tmp_path):
    """vLLM's own check of the LoRA config (here DoRA) runs before the engine starts and before any step,
    where vLLM would raise at the first adapter sync: one line, no run left."""
    pytest.importorskip("vllm")
    from peft import LoraConfig

    LoraConfig(r=8, target_modules=["q_proj"], use_dora=True).save_pretrained(str(tmp_path / "dora"))
    code, _, err = rlhf("train", "--lora.config", str(tmp_path / "dora"), "--generation.backend", "vllm",
                        "--sync.method", "adapter", *short_run())
    check_one_line_error(code, err, "vLLM cannot load this LoRA adapter (vLLM does not yet support DoRA); train "
                                    "with merged weights instead (drop --sync.method adapter), or evaluate it with "
                                    "--generation.backend transformers")
    assert no_run_dirs()


def test_vllm_build_without_lora_is_refused_before_start(rlhf, monkeypatch):
    block_import(monkeypatch, "vllm.lora.request")
    code, _, err = rlhf("train", "--lora.rank", "8", "--sync.method", "adapter", "--generation.backend", "vllm")
    assert code == 2 and "this vLLM build has no LoRA support (vllm.lora)" in err


def test_trl_reward_keywords_trainer_state_log_metric_and_log_extra_work(rlhf, tmp_path):
    """TRL 1.16 passes reward functions trainer_state, log_extra and log_metric besides the columns: a
    reward that uses them runs unchanged, its logged metric lands in metrics.jsonl, and trainer_state
    counts the updates made and the passes over the prompts before the step's (its epoch; each step's
    metrics carry the passes after it as ``epoch``, TRL's name)."""
    plugin = tmp_path / "trl_reward.py"
    plugin.write_text(textwrap.dedent("""
        def logs(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
            log_metric("my/length", sum(len(c) for c in completions) / len(completions))
            log_metric("my/step_seen", trainer_state.global_step)
            log_extra("length", [len(c) for c in completions])
            log_metric("my/max_steps", trainer_state.max_steps)
            log_metric("my/epoch", trainer_state.epoch)
            return [float(len(c) < 3) for c in completions]
    """))
    code, _, err = rlhf("train", "--plugin", str(plugin), *short_run("--data.max_samples", "10",
                                                                     "--train.log_samples_every", "1"))
    assert code == 0, err
    rows = metrics_of(the_run())
    # log_extra's column beside each sample in samples.jsonl (TRL: its completions table)
    assert all(r["extra"] == {"length": len(r["completion"])} for r in samples_of(the_run()))
    assert [(r["my/step_seen"], r["my/max_steps"]) for r in rows] == [(0.0, 3.0), (1.0, 3.0), (2.0, 3.0)]
    # 4 of the 10 prompts a step: the third step's prompts are the last two and two of the second pass
    assert [r["my/epoch"] for r in rows] == pytest.approx([0.0, 0.4, 0.8])
    assert [r["epoch"] for r in rows] == pytest.approx([0.4, 0.8, 1.2])
    # two epochs over each step's samples: two optimizer updates per step, which TRL counts as its steps
    code, _, err = rlhf("train", "--plugin", str(plugin), *short_run("--learner.epochs", "2", "--train.steps", "2",
                                                                "--train.output_dir", "twice"))
    assert code == 0, err
    assert [(r["my/step_seen"], r["my/max_steps"]) for r in metrics_of(the_run(Path("twice")))] == [(0.0, 4.0), (2.0, 4.0)]
    assert all(r["my/length"] >= 0 for r in rows)


def test_trl_prompt_formats_reach_the_model_as_trl_feeds_them(tiny_model):
    """A plain-string prompt ("standard") is tokenized as it is and a list of messages
    ("conversational") goes through the chat template -- token for token what TRL's GRPOTrainer feeds;
    rlhf train's own default templates plain strings too (and says so in its printed config)."""
    from transformers import AutoTokenizer

    from rlhf_plugins.api import prepare
    from rlhf_plugins.data.prompts import load_prompts
    from rlhf_plugins.integrations.trl import from_grpo_fields

    tok = AutoTokenizer.from_pretrained(tiny_model)
    raw, _ = from_grpo_fields({})
    config, _, _ = prepare(raw, autoload=False)
    rows = [{"prompt": "3+4=", "label": "7"}, {"prompt": [{"role": "user", "content": "3+4="}], "label": "7"}]
    ours = load_prompts(config.data, tok, rows=rows).prompt_ids
    trl_standard = tok(text=["3+4="])["input_ids"][0]  # trl GRPOTrainer._tokenize_prompts, standard format
    trl_chat = tok.apply_chat_template([rows[1]["prompt"]], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"][0]
    assert ours == [trl_standard, trl_chat] and trl_standard != trl_chat
    default, _, _ = prepare({}, autoload=False)
    assert load_prompts(default.data, tok, rows=rows[:1]).prompt_ids == [trl_chat]


def test_the_trl_drop_in_offers_what_scripts_use_after_train(tmp_path, tiny_model, monkeypatch):
    """save_model, state.log_history, state.epoch, model, processing_class and TRL's TrainOutput; without
    max_steps the run lasts num_train_epochs passes over the data; shuffle_dataset is honoured."""
    import yaml
    from trl import GRPOConfig

    from rlhf_plugins.integrations.trl import GRPOTrainer
    from rlhf_plugins.models.tiny_model import task_rows

    monkeypatch.chdir(tmp_path)
    rows = task_rows("train")[:16]
    args = GRPOConfig(output_dir=str(tmp_path / "out"), num_train_epochs=2, per_device_train_batch_size=16,
                      num_generations=4, max_completion_length=4, shuffle_dataset=False, use_cpu=True, bf16=False,
                      report_to=[])
    trainer = GRPOTrainer(model=tiny_model, reward_funcs="rlhf_plugins.builtin_plugins.rewards.exact_match",
                          args=args, train_dataset=rows, rlhf={"eval": {"enabled": False}, "train": {"progress": False}})
    out = trainer.train()
    assert out.global_step == 8  # 2 epochs x 16 prompts / 4 prompts per step
    assert trainer.state.global_step == 8 and len(trainer.state.log_history) == 8
    # TRL's epoch: passes over the 16 prompts, a quarter a step
    assert trainer.state.epoch == 2.0 and [r["epoch"] for r in trainer.state.log_history[:2]] == [0.25, 0.5]
    last = trainer.state.log_history[-1]
    assert {"loss", "reward", "step"} <= set(last)
    assert last["rewards/exact_match/mean"] == last["reward"]  # the one function's mean, as TRL logs it
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "config.json").is_file() and (tmp_path / "saved" / "tokenizer.json").is_file()
    policy = trainer.model  # the trained one: final/ of the run
    assert policy.config.vocab_size == len(trainer.processing_class) and policy.name_or_path.endswith("final")
    saved = yaml.safe_load((trainer.run_dir / "config.yaml").read_text())
    assert saved["data"]["shuffle"] is False and saved["data"]["template_strings"] is False


def test_trl_steps_are_optimizer_updates_where_a_generation_feeds_several(tmp_path, tiny_model, monkeypatch):
    """With num_iterations 2 each rollout makes two updates: TRL's global_step, max_steps, log steps, steps/s
    and the reward's trainer_state count updates, and so do eval_steps (4: every 2 rollouts, with an
    eval_dataset) and save_steps (2: every rollout, save_total_limit 3 kept where ours keeps 2); the log
    history has TRL's names too."""
    from trl import GRPOConfig

    from rlhf_plugins.integrations.trl import GRPOTrainer
    from rlhf_plugins.models.tiny_model import task_rows
    from tests.helpers import eval_rows_of

    seen: list[tuple[int, int]] = []

    def reward(prompts, completions, trainer_state, **kwargs):
        if len(completions) == 8:  # a training rollout's (2 prompts x 4), not a held-out evaluation's
            seen.append((trainer_state.global_step, trainer_state.max_steps))
        return [0.0] * len(completions)

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    monkeypatch.chdir(tmp_path)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=6, num_iterations=2, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=4, use_cpu=True, bf16=False, report_to=[],
                      eval_strategy="steps", eval_steps=4, save_steps=2, save_total_limit=3)
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[reward, length], args=args,
                          train_dataset=task_rows("train")[:16], eval_dataset=task_rows("test")[:4],
                          rlhf={"train": {"progress": False}})
    out = trainer.train()
    assert out.global_step == 6 and seen == [(0, 6), (2, 6), (4, 6)]
    assert out.metrics["train_steps_per_second"] == pytest.approx(2 / out.metrics["seconds_per_step"])
    state = trainer.state
    assert (state.global_step, state.max_steps) == (6, 6)
    # a dict per update step, and one per held-out evaluation after it (TRL's eval_reward), at TRL's steps
    assert [(row["step"], "eval_reward" in row) for row in state.log_history] == [
        (0, True), (2, False), (4, False), (4, True), (6, False), (6, True)]
    evals = [row for row in state.log_history if "eval_reward" in row]
    assert [row["eval_pass@1"] for row in evals] == [r["eval/pass@1"] for r in eval_rows_of(trainer.run_dir)]
    last = [row for row in state.log_history if "loss" in row][-1]  # TRL's names for the same quantities, beside ours
    assert last["rewards/reward/mean"] == 0.0 and last["rewards/length/mean"] == last["reward/length"] > 0
    assert last["learning_rate"] == last["lr"] and last["completions/mean_length"] == last["completion/length"]
    assert 0 <= last["frac_reward_zero_std"] == last["reward/zero_std_frac"] <= 1
    assert last["reward_std"] == last["reward/std"] > 0
    assert last["completions/min_length"] <= last["completions/mean_length"] <= last["completions/max_length"] <= 4
    assert last["completions/clipped_ratio"] == pytest.approx(1 - last["completion/stopped"])
    assert last["rewards/length/std"] == last["reward_std/length"] > 0 and last["rewards/reward/std"] == 0.0
    assert 0 < last["entropy"] < 6  # measured at every update, as by TRL (algo.policy_loss.log_entropy)
    # TRL's default loss (dapo) clips: the shares clipped below and above the band, and either
    assert last["clip_ratio/region_mean"] == last["loss/clip_frac"]
    assert last["clip_ratio/low_mean"] + last["clip_ratio/high_mean"] == pytest.approx(last["clip_ratio/region_mean"])
    assert 0 <= last["clip_ratio/low_min"] <= last["clip_ratio/low_mean"]  # extremes over sequences
    assert last["clip_ratio/high_mean"] <= last["clip_ratio/high_max"] <= 1
    rows = [r for r in metrics_of(trainer.run_dir) if "reward/mean" in r]
    assert last["num_tokens"] == sum(r["tokens/step"] for r in rows) > 0  # TRL's: the tokens of the steps so far
    assert last["completions/mean_terminated_length"] == last["completion/terminated_length"]
    assert last["policy_loss"] == last["loss/policy"] and "aux_loss" not in last and "tools/call_frequency" not in last
    assert "rewards/zero_std_frac/mean" not in last  # a metric of ours, not a reward function's
    assert [r["step"] for r in eval_rows_of(trainer.run_dir)] == [0, 2, 3]  # in rollouts: TRL's 0, 4 and the end
    kept = sorted(p.name for p in (trainer.run_dir / "checkpoints").iterdir())
    assert kept == ["step-000001", "step-000002", "step-000003"]


def test_completion_length_range_is_the_model_tokens_of_the_shortest_and_longest_sample():
    """``completion/min_length`` and ``completion/max_length`` (TRL's ``completions/min_length`` and
    ``/max_length``): the fewest and most completion tokens of a step's samples, padding not counted."""
    import torch

    from rlhf_plugins.training.rollout import make_batch, rollout_metrics
    from tests.helpers import random_rollout

    rollout = random_rollout(group=3, prompts=4, seed=7)
    lengths = [len(c) for c in rollout.completion_ids]
    batch = make_batch(rollout, pad_id=0)
    batch["advantages"] = torch.zeros_like(batch["action_mask"], dtype=torch.float32)
    got = rollout_metrics(rollout, batch, None, 0.0)
    assert (got["completion/min_length"], got["completion/max_length"]) == (min(lengths), max(lengths))
    assert got["completion/length"] == pytest.approx(sum(lengths) / len(lengths)) and min(lengths) < max(lengths)


def test_terminated_lengths_and_the_steps_tokens_are_trls():
    """TRL's ``completions/mean_terminated_length`` (and min / max): the lengths of the completions that stopped
    of themselves -- 0 when none did, as TRL's -- and ``tokens/step``, the prompt and completion tokens that TRL's
    ``num_tokens`` adds up step by step."""
    import statistics

    import torch

    from rlhf_plugins.training.rollout import make_batch, rollout_metrics
    from tests.helpers import random_rollout

    rollout = random_rollout(group=3, prompts=4, seed=7)
    lengths = [len(c) for c in rollout.completion_ids]
    rollout.finish_reasons = ["length" if n == max(lengths) else "stop" for n in lengths]  # the budget cut the longest
    ended = [n for n, r in zip(lengths, rollout.finish_reasons) if r == "stop"]
    batch = make_batch(rollout, pad_id=0)
    batch["advantages"] = torch.zeros_like(batch["action_mask"], dtype=torch.float32)
    got = rollout_metrics(rollout, batch, None, 0.0)
    assert got["completion/terminated_length"] == pytest.approx(statistics.fmean(ended), rel=1e-12)
    assert (got["completion/min_terminated_length"], got["completion/max_terminated_length"]) == (min(ended), max(ended))
    assert max(ended) < max(lengths) and min(ended) == min(lengths)  # the cut ones are left out
    assert got["tokens/step"] == sum(len(p) for p in rollout.prompt_ids) + sum(lengths)
    rollout.finish_reasons = ["length"] * 12
    got = rollout_metrics(rollout, batch, None, 0.0)
    assert [got[f"completion/{k}terminated_length"] for k in ("", "min_", "max_")] == [0.0, 0.0, 0.0]


def test_log_history_names_tool_use_and_the_extra_loss_terms_as_trl_does():
    """Where a run has them: TRL's tools/call_frequency (calls per completion) and /failure_frequency (failures
    per call), entropy_coef, aux_loss, policy_loss and the importance sampling's sampling/*, beside ours; absent
    where the run has none."""
    from rlhf_plugins.integrations.trl_state import _trl_row

    row = {"reward/mean": 1.0, "env/tool_calls": 1.5, "env/tool_failure_rate": 0.25, "entropy/coef": 0.01,
           "loss/router_aux": 0.3, "loss/policy": -0.1, "mismatch/abs_log_ratio": 0.02,
           "mismatch/abs_log_ratio_max": 0.4, "mismatch/weight_min": 0.0, "mismatch/weight_mean": 0.9,
           "mismatch/weight_max": 1.7}
    named = _trl_row(row)
    assert (named["tools/call_frequency"], named["tools/failure_frequency"], named["entropy_coef"],
            named["aux_loss"], named["policy_loss"]) == (1.5, 0.25, 0.01, 0.3, -0.1)
    assert [named[f"sampling/sampling_logp_difference/{k}"] for k in ("mean", "max")] == [0.02, 0.4]
    assert [named[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")] == [0.0, 0.9, 1.7]
    plain = _trl_row({"reward/mean": 1.0})
    assert not {"tools/call_frequency", "entropy_coef", "aux_loss", "policy_loss",
                "sampling/importance_sampling_ratio/mean"} & set(plain)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reward_std_and_frac_reward_zero_std_are_trls(seed):
    """A step's ``reward/std`` and ``reward/zero_std_frac`` (TRL's ``reward_std`` and ``frac_reward_zero_std``
    in log_history): the spread of the rewards and the share of prompts with no reward signal, as TRL 1.16
    computes them (its nanstd over the batch; per group, isclose to 0, over the samples), on rewards where
    some groups are constant; both are of the rewards before shaping, as ``reward/mean``."""
    import torch
    from trl.trainer.utils import nanstd

    from rlhf_plugins.training.rollout import make_batch, rollout_metrics
    from tests.helpers import random_rollout

    g = torch.Generator().manual_seed(seed)
    rollout = random_rollout(group=4, prompts=6, seed=seed)
    rewards = torch.randint(0, 2, (6, 4), generator=g).double()  # 0/1 rewards: some groups all 0 or all 1
    rewards[torch.randint(0, 6, (1,), generator=g)] = 0.5
    rollout.raw_scores = rewards.flatten().tolist()
    rollout.scores = (rewards.flatten() * 2 - 1).tolist()  # shaped
    batch = make_batch(rollout, pad_id=0)
    batch["advantages"] = torch.zeros_like(batch["action_mask"], dtype=torch.float32)
    got = rollout_metrics(rollout, batch, None, 0.0)
    std = nanstd(rewards, dim=1).repeat_interleave(4)  # TRL's _generate_and_score_completions
    want = torch.isclose(std, torch.zeros_like(std)).double().mean().item()  # TRL averages in float32
    assert got["reward/zero_std_frac"] == pytest.approx(want, abs=1e-12) and 0 < want < 1
    assert got["reward/std"] == pytest.approx(float(rewards.flatten().std()), rel=1e-12)  # unbiased, as TRL's
    assert got["reward/std"] == pytest.approx(nanstd(rewards.flatten()).item(), rel=1e-6)  # its n/(n-1) in float32


@pytest.mark.parametrize("seed", [0, 1])
def test_each_reward_functions_std_is_trls_over_the_samples_it_scored(seed):
    """``reward_std/<name>`` (TRL's ``rewards/<name>/std``): each function's spread over the samples it did
    not abstain from (None), as TRL 1.16's nanstd computes it; one scored sample has none (0)."""
    import torch
    from trl.trainer.utils import nanstd

    from rlhf_plugins.training.rollout import make_batch, rollout_metrics
    from tests.helpers import random_rollout

    g = torch.Generator().manual_seed(seed)
    rollout = random_rollout(group=4, prompts=3, seed=seed)
    scored = torch.rand(12, generator=g).double()
    abstains = torch.rand(12, generator=g) < 0.3
    rollout.reward_components = {"a": [None if skip else float(v) for v, skip in zip(scored, abstains)],
                                 "b": [None] * 11 + [1.5]}
    batch = make_batch(rollout, pad_id=0)
    batch["advantages"] = torch.zeros_like(batch["action_mask"], dtype=torch.float32)
    got = rollout_metrics(rollout, batch, None, 0.0)
    theirs = nanstd(torch.where(abstains, torch.nan, scored).float()).item()
    assert 0 < abstains.sum() < 12 and got["reward_std/a"] == pytest.approx(theirs, rel=1e-6)
    assert got["reward/a"] == pytest.approx(float(scored[~abstains].mean()), rel=1e-12)
    assert (got["reward/b"], got["reward_std/b"]) == (1.5, 0.0)


def test_the_trl_drop_in_runs_what_trl_and_open_r1_scripts_call_after_train(tmp_path, tiny_model, monkeypatch, capsys):
    """A tokenizer passed with its own chat template renders the run's prompts; TRL's grpo.py and open-r1's
    end with accelerator.print, log_metrics / save_metrics / save_state,
    create_model_card, an edit of trainer.model.config saved beside the model, evaluate() (needs an
    eval_dataset), push_to_hub (one line: nothing is uploaded) and end()."""
    from trl import GRPOConfig

    from rlhf_plugins.integrations.trl import GRPOTrainer
    from rlhf_plugins.models.tiny_model import task_rows

    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "out"
    args = GRPOConfig(output_dir=str(out_dir), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=4, use_cpu=True, bf16=False, report_to=[])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = "{# the script's own #}" + tokenizer.chat_template  # open-r1's --chat_template
    trainer = GRPOTrainer(model=tiny_model, reward_funcs="rlhf_plugins.builtin_plugins.rewards.exact_match", args=args,
                          train_dataset=task_rows("train")[:16], processing_class=tokenizer,
                          rlhf={"eval": {"enabled": False}, "train": {"progress": False}})
    assert trainer.args is args and trainer.processing_class is tokenizer
    metrics = trainer.train().metrics
    assert metrics["train_runtime"] == pytest.approx(2 * metrics["seconds_per_step"])
    assert metrics["train_steps_per_second"] == pytest.approx(1 / metrics["seconds_per_step"])
    saved = yaml.safe_load((trainer.run_dir / "config.yaml").read_text())
    assert saved["data"]["chat_template"] == tokenizer.chat_template  # the tokenizer's template is the run's
    metrics["train_samples"] = 16
    capsys.readouterr()
    trainer.accelerator.print("done")
    trainer.log_metrics("train", metrics)
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == ["done", "***** train metrics *****"]
    assert any(line.split() == ["train_samples", "=", "16"] for line in printed)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    trainer.save_model(str(out_dir))
    if trainer.accelerator.is_main_process:
        trainer.create_model_card(dataset_name="sums", tags=["open-r1"])
        trainer.model.config.use_cache = False  # the same object each time: the edit sticks
        trainer.model.config.save_pretrained(str(out_dir))
    assert json.loads((out_dir / "train_results.json").read_text())["train_samples"] == 16
    assert json.loads((out_dir / "all_results.json").read_text())["train_loss"] == metrics["train_loss"]
    state = json.loads((out_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and len(state["log_history"]) == 2
    card = (out_dir / "README.md").read_text()
    assert f"base_model: {tiny_model}" in card and "datasets: [sums]" in card and "open-r1" in card
    assert json.loads((out_dir / "config.json").read_text())["use_cache"] is False
    with pytest.raises(ConfigError, match="evaluate\\(\\) reads the run's held-out evaluation: pass eval_dataset"):
        trainer.evaluate()
    with pytest.raises(ConfigError, match=f"push_to_hub: rlhf-plugins uploads nothing; .* `hf upload <repo> {out_dir}`"):
        trainer.push_to_hub(dataset_name="sums")
    trainer.end()


@pytest.mark.parametrize("kind, lora", [
    # "all-linear" on Qwen3-MoE: PEFT adapts the fused expert tensors (laid out experts x out x in),
    # nested on one module, and the router's 2-D weight
    ("qwen3_moe", dict(target_modules="all-linear")),
    # gpt-oss lays its experts out experts x in x out; PEFT's all-linear leaves them, so name them
    ("gpt_oss", dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
], ids=["qwen3-moe-all-linear", "gpt-oss-expert-parameters"])
def test_a_lora_on_fused_expert_tensors_merges_as_peft_does(kind, lora):
    """The merged export the engines load (one low-rank pair per expert folded into each fused 3-D
    expert tensor) equals PEFT's own merge_and_unload, tensor for tensor."""
    import torch
    from peft import LoraConfig, get_peft_model

    needs_release_with("peft", LoraConfig, "target_parameters")  # PEFT 0.17's LoRA on parameters
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_plugins.models.lora import param_wrappers

    experts = dict(moe_intermediate_size=24, num_experts=4) if kind == "qwen3_moe" else dict(
        num_local_experts=4, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    config = AutoConfig.for_model(kind, vocab_size=64, hidden_size=32, intermediate_size=24, num_experts_per_tok=2,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  **experts)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, lora_alpha=8, **lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: nothing would be merged
                p.normal_(0, 0.1)
    assert {k for k, wrapped in param_wrappers(model).items() if wrapped.experts > 1} == {
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")}
    ours, held = _merged_as_it_streams(model)
    want = model.merge_and_unload().state_dict()
    assert sorted(ours) == sorted(want)
    assert held <= 8 < len(want)  # one layer's experts: gate_up, down, their biases (gpt-oss), a LoRA pair each
    for name, tensor in want.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_a_peft_config_reaches_the_run_whole(tmp_path, tiny_model, monkeypatch):
    """GRPOTrainer(peft_config=LoraConfig(...)): rank, alpha, dropout and targets become the lora section;
    a config that sets more (DoRA, rsLoRA) travels whole as its adapter_config.json, and the adapter the
    run saves is a DoRA one; another PEFT method is one error."""
    from peft import IA3Config, LoraConfig
    from trl import GRPOConfig

    from rlhf_plugins.integrations.trl import GRPOTrainer
    from rlhf_plugins.models.tiny_model import task_rows

    monkeypatch.chdir(tmp_path)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=4, use_cpu=True, bf16=False, report_to=[])
    reward = "rlhf_plugins.builtin_plugins.rewards.exact_match"
    plain = GRPOTrainer(model=tiny_model, reward_funcs=reward, args=args,
                        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    assert plain.raw["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    dora = GRPOTrainer(model=tiny_model, reward_funcs=reward, args=args, train_dataset=task_rows("train")[:8],
                       peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True, use_rslora=True),
                       rlhf={"eval": {"enabled": False}, "train": {"progress": False}})
    assert dora.raw["lora"] == {"config": str(tmp_path / "out" / "peft_config")}
    dora.train()
    saved = json.loads((dora.run_dir / "final" / "adapter_config.json").read_text())
    assert saved["use_dora"] is True and saved["use_rslora"] is True and saved["target_modules"] == ["q_proj"]
    with pytest.raises(ConfigError, match="peft_config is a IA3Config; rlhf-plugins trains LoRA adapters"):
        GRPOTrainer(model=tiny_model, reward_funcs=reward, args=args, peft_config=IA3Config(target_modules=["q_proj"]))


def test_a_peft_model_given_to_the_trl_trainer_goes_on_training_its_adapter(tmp_path, tiny_model, monkeypatch):
    """GRPOTrainer(model=PeftModel.from_pretrained(base, folder, is_trainable=True)), as TRL takes it: the run
    goes on training that adapter (its config and weights: the policy starts away from the base, KL > 0 at the
    first step, with the engine sampling from it) rather than training the bare base; with peft_config too, or
    another PEFT method, it is one error."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig

    from rlhf_plugins.integrations.trl import GRPOTrainer
    from rlhf_plugins.models.tiny_model import task_rows

    monkeypatch.chdir(tmp_path)
    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=4, target_modules=["q_proj"]))
    with torch.no_grad():  # a trained adapter: B away from PEFT's zero
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    trained.save_pretrained(str(tmp_path / "adapter"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(tmp_path / "adapter"),
                                      is_trainable=True)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=4, beta=0.04, use_cpu=True, bf16=False, report_to=[])
    reward = "rlhf_plugins.builtin_plugins.rewards.exact_match"
    refused = GRPOConfig(output_dir=str(tmp_path / "refused"), use_cpu=True, bf16=False, report_to=[])
    with pytest.raises(ConfigError, match="no reward source"):  # refused before the adapter is written
        GRPOTrainer(model=model, args=refused, eval_dataset=task_rows("test")[:4])
    assert not (tmp_path / "refused").exists()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=task_rows("train")[:8],
                          rlhf={"eval": {"enabled": False}, "train": {"progress": False}})
    assert trainer.raw["lora"] == {"adapter": str(tmp_path / "out" / "initial_adapter")}
    assert trainer.raw["model"]["path"] == str(Path(tiny_model).resolve())
    trainer.train()
    row = metrics_of(trainer.run_dir)[0]
    assert row["kl"] > 0.01 and row["mismatch/abs_log_ratio"] < 1e-4, row
    with pytest.raises(ConfigError, match="model is a PeftModel and peft_config is given too"):
        GRPOTrainer(model=model, reward_funcs=reward, args=args, peft_config=LoraConfig(r=4))


def test_a_model_the_script_changed_after_loading_is_the_one_trained(tmp_path, tiny_model, monkeypatch):
    """A script that adds a token and resizes the embeddings hands TRL the changed model, which TRL trains: so
    does the run -- the model and its tokenizer saved as <output_dir>/initial_model and trained from there (it
    trained the folder's unchanged model, silently); an unchanged model trains from its own folder, nothing
    copied; frozen parameters, which TRL's optimizer leaves out, are one error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from rlhf_plugins.integrations.trl import GRPOTrainer
    from rlhf_plugins.models.tiny_model import task_rows

    monkeypatch.chdir(tmp_path)

    def trainer(model, out, tokenizer=None):
        args = GRPOConfig(output_dir=str(tmp_path / out), max_steps=1, per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=4, use_cpu=True, bf16=False, report_to=[])
        return GRPOTrainer(model=model, processing_class=tokenizer, args=args, train_dataset=task_rows("train")[:8],
                           reward_funcs="rlhf_plugins.builtin_plugins.rewards.exact_match",
                           rlhf={"eval": {"enabled": False}, "train": {"progress": False}})

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert trainer(model, "same").raw["model"]["path"] == str(Path(tiny_model).resolve())
    assert not (tmp_path / "same" / "initial_model").exists()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    model.resize_token_embeddings(len(tokenizer))
    resized = trainer(model, "resized", tokenizer)
    assert resized.raw["model"]["path"] == str(tmp_path / "resized" / "initial_model")
    assert any("changed after loading" in note for note in resized.notes)
    resized.train()
    final = resized.run_dir / "final"
    assert json.loads((final / "config.json").read_text())["vocab_size"] == len(tokenizer)
    assert len(AutoTokenizer.from_pretrained(final)) == len(tokenizer)
    frozen = AutoModelForCausalLM.from_pretrained(tiny_model)
    frozen.model.embed_tokens.weight.requires_grad_(False)
    with pytest.raises(ConfigError, match=r"model has 1 frozen parameters \(model.embed_tokens.weight, ...: "
                                          r"requires_grad False\), which TRL's optimizer leaves out"):
        trainer(frozen, "frozen")


def test_a_model_the_script_loaded_from_pickled_weights_trains_from_a_safetensors_copy(tmp_path, tiny_model,
                                                                                       monkeypatch):
    """transformers loads a folder of pickled weights (pytorch_model.bin), which a run does not unpickle: the
    model the script loaded is saved as <output_dir>/initial_model in safetensors, with the folder's tokenizer,
    and the run trains it (it stopped on the folder's pickled weights); the folder's path alone is one line."""
    import shutil

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig

    from rlhf_plugins.integrations.trl import GRPOTrainer
    from rlhf_plugins.models.tiny_model import task_rows

    monkeypatch.chdir(tmp_path)
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_model, pickled, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    torch.save(weights, pickled / "pytorch_model.bin")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=4, use_cpu=True, bf16=False, report_to=[])
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(pickled), args=args,
                          train_dataset=task_rows("train")[:8],
                          reward_funcs="rlhf_plugins.builtin_plugins.rewards.exact_match",
                          rlhf={"eval": {"enabled": False}, "train": {"progress": False}})
    initial = tmp_path / "out" / "initial_model"
    assert trainer.raw["model"]["path"] == str(initial)
    assert any("loaded from pickled weights (pytorch_model.bin)" in note for note in trainer.notes), trainer.notes
    saved = load_file(initial / "model.safetensors")
    assert saved.keys() <= weights.keys() and all(torch.equal(saved[k], weights[k]) for k in saved)
    assert (initial / "tokenizer.json").is_file() and not list(initial.glob("*.bin"))
    trainer.train()
    assert [r["step"] for r in metrics_of(trainer.run_dir)] == [0]
    with pytest.raises(ConfigError, match=r"holds pickled weights \(pytorch_model.bin\), which rlhf-plugins does not "
                                          r"load"):
        GRPOTrainer(model=str(pickled), args=args, train_dataset=task_rows("train")[:8],
                    reward_funcs="rlhf_plugins.builtin_plugins.rewards.exact_match").train()


def test_a_reward_model_among_trls_reward_funcs_scores_the_run(tmp_path, tiny_model, monkeypatch):
    """TRL loads a reward_funcs entry naming a model as a sequence classifier: a folder (or a model loaded
    from one) becomes reward.models, reward_weights follow it into our order (functions, then models), and
    the run logs the model's scores; a model that is not from a folder is one error."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig
    from trl import GRPOConfig

    from rlhf_plugins.integrations.trl import GRPOTrainer
    from rlhf_plugins.models.tiny_model import task_rows
    from tests.helpers import make_reward_model

    monkeypatch.chdir(tmp_path)
    rm = make_reward_model(tmp_path / "rm")
    shape = dict(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                 max_completion_length=4, use_cpu=True, bf16=False, report_to=[])
    args, one = GRPOConfig(**shape, reward_weights=[0.5, 1.0]), GRPOConfig(**shape)
    match = "rlhf_plugins.builtin_plugins.rewards.exact_match"
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[str(rm), match], args=args, train_dataset=task_rows("train")[:8],
                          rlhf={"eval": {"enabled": False}, "train": {"progress": False}})
    assert trainer.raw["reward"]["models"] == [str(rm.resolve())] and trainer.raw["reward"]["functions"] == ["exact_match"]
    assert trainer.raw["reward"]["weights"] == [1.0, 0.5]
    trainer.train()
    row = metrics_of(trainer.run_dir)[0]  # the model's weight 0.5 (first in TRL's order), the function's 1.0
    assert row["reward/mean"] == pytest.approx(row["reward/exact_match"] + 0.5 * row["reward/rm"], rel=1e-9)
    loaded = AutoModelForSequenceClassification.from_pretrained(rm)
    assert GRPOTrainer(model=tiny_model, reward_funcs=loaded, args=one).raw["reward"]["models"] == [str(rm.resolve())]
    with pytest.raises(ConfigError, match="TRL reward_weights has 2 values for 1 reward_funcs; give one each"):
        GRPOTrainer(model=tiny_model, reward_funcs=[str(rm)], args=args)
    unsaved = AutoModelForSequenceClassification.from_config(LlamaConfig(num_hidden_layers=1, hidden_size=8,
                                                                         intermediate_size=16, num_attention_heads=2))
    with pytest.raises(ConfigError, match="is not a local folder; save it with save_pretrained and pass the folder"):
        GRPOTrainer(model=tiny_model, reward_funcs=unsaved, args=one)


def test_trl_scripts_reward_names_and_reward_model_convert(tmp_path, monkeypatch):
    """`trl grpo`'s YAML: reward_funcs may name TRL's own rewards (its script's registry, trl.rewards),
    reward_model_name_or_path adds a reward model first in TRL's order; the weights follow it into ours
    (functions, then models). The soft-overlong factory is one line pointing at our overlong penalty."""
    import yaml

    from rlhf_plugins.api import prepare
    from rlhf_plugins.integrations.trl_config import from_trl_yaml
    from tests.helpers import make_reward_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("def short(prompts, completions, **kw):\n    return [-len(c) for c in completions]\n")
    rm = make_reward_model(tmp_path / "rm")
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(yaml.safe_dump({"reward_funcs": ["think_format_reward", "mine.short"],
                                   "reward_model_name_or_path": str(rm), "reward_weights": [0.5, 1.0, 2.0]}))
    raw, _, plugins = from_trl_yaml(cfg)
    assert plugins == ["trl.rewards.format_rewards", "mine"]
    assert raw["reward"]["functions"] == ["think_format_reward", "short"] and raw["reward"]["models"] == [str(rm)]
    assert raw["reward"]["weights"] == [1.0, 2.0, 0.5]
    config, _, plan = prepare(raw, plugins, autoload=False)
    assert plan.rewards == ["think_format_reward", "short"] and plan.weights == [1.0, 2.0, 0.5]
    cfg.write_text(yaml.safe_dump({"reward_funcs": ["mine.short"], "reward_model_name_or_path": str(rm),
                                   "reward_weights": [1.0]}))
    with pytest.raises(ConfigError, match="TRL reward_weights has 1 values for 2 reward sources"):
        from_trl_yaml(cfg)
    cfg.write_text(yaml.safe_dump({"reward_funcs": ["get_soft_overlong_punishment"]}))
    with pytest.raises(ConfigError, match="is --reward.overlong_buffer N --reward.overlong_penalty 1 here"):
        from_trl_yaml(cfg)
    cfg.write_text(yaml.safe_dump({"reward_funcs": ["nonsense"]}))
    with pytest.raises(ConfigError, match="'nonsense' must be 'module.function' or one of TRL's: accuracy_reward, "
                                          r".*or open-r1's: accuracy, format, .*rlhf_plugins.integrations.trl"):
        from_trl_yaml(cfg)


def test_a_trl_yamls_model_config_fields_convert_with_use_peft(tmp_path):
    """`trl grpo --config`'s file holds TRL's ModelConfig fields too: dtype, and the LoRA of use_peft (left
    unused without it, as TRL leaves it); a PEFT setting a plain LoRA cannot honour is one line."""
    import yaml

    from rlhf_plugins.integrations.trl_config import from_trl_yaml

    cfg = tmp_path / "grpo.yaml"
    base = {"learning_rate": 1e-4, "lora_r": 8, "lora_alpha": 16, "lora_target_modules": ["q_proj", "v_proj"],
            "dtype": "bfloat16", "attn_implementation": "sdpa"}
    cfg.write_text(yaml.safe_dump({**base, "use_peft": True}))
    raw, notes, _ = from_trl_yaml(cfg)
    assert raw["lora"] == {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    assert raw["model"]["dtype"] == "bfloat16" and raw["learner"]["lr"] == 1e-4
    assert "TRL field 'attn_implementation' is ignored: transformers' default attention (SDPA) runs" in notes
    cfg.write_text(yaml.safe_dump(base))  # no use_peft: TRL trains the whole model
    assert "lora" not in from_trl_yaml(cfg)[0]
    cfg.write_text(yaml.safe_dump({**base, "use_peft": True, "use_dora": True}))
    with pytest.raises(ConfigError, match=r"TRL field 'use_dora' \(DoRA\) has no plain-field equivalent here; put it "
                                          "in a PEFT adapter_config.json and give it as --lora.config"):
        from_trl_yaml(cfg)


def test_the_trl_drop_in_takes_eval_dataset_a_loaded_model_and_resumes_as_trl_does(tmp_path, tiny_model, monkeypatch):
    """eval_dataset is the held-out set; a model loaded from a folder is that folder; train(
    resume_from_checkpoint=True) continues the newest run under output_dir to a larger max_steps;
    TrainerCallbacks and ready-made optimizers, which only TRL's loop would call, a dict of eval datasets
    (TRL's evaluations by name) and an image column (TRL's vision-language input) are one line each."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig

    from rlhf_plugins.integrations.trl import GRPOTrainer
    from rlhf_plugins.models.tiny_model import task_rows
    from tests.helpers import eval_rows_of

    monkeypatch.chdir(tmp_path)
    rows, held_out = task_rows("train")[:16], task_rows("test")[:6]

    def trainer(steps, **extra):
        args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=4, use_cpu=True, bf16=False, report_to=[])
        return GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model), args=args, train_dataset=rows,
                           reward_funcs="rlhf_plugins.builtin_plugins.rewards.exact_match",
                           rlhf={"train": {"progress": False, "save_every": 1}}, **extra)

    first = trainer(2, eval_dataset=held_out)
    assert first.model_path == str(Path(tiny_model).resolve())
    first.train()
    saved = yaml.safe_load((first.run_dir / "config.yaml").read_text())
    assert saved["eval"]["path"] == str(tmp_path / "out" / "eval_dataset.jsonl")
    assert len((tmp_path / "out" / "eval_dataset.jsonl").read_text().splitlines()) == 6
    assert [r["step"] for r in eval_rows_of(first.run_dir)] == [0, 2]
    last = eval_rows_of(first.run_dir)[-1]  # evaluate(): the trained policy's, keyed as transformers keys them
    mean = next(k for k in last if k.startswith("eval/mean@"))  # TRL's eval_reward: the samples' mean reward
    want = {**{f"eval_{k[5:]}": v for k, v in last.items() if k.startswith("eval/")}, "eval_reward": last[mean]}
    assert first.evaluate() == want and first.evaluate()["eval_pass@1"] == last["eval/pass@1"]
    again = trainer(4, eval_dataset=held_out)
    assert again.train(resume_from_checkpoint=True).global_step == 4 and again.run_dir == first.run_dir
    with pytest.raises(ConfigError, match="callbacks are transformers TrainerCallbacks, which this loop does not call"):
        trainer(2, callbacks=[object()])
    with pytest.raises(ConfigError, match=r"optimizers=\(optimizer, scheduler\) are built for TRL's Trainer"):
        trainer(2, optimizers=(object(), None))
    with pytest.raises(ConfigError, match="reward_funcs entry 'Qwen/Qwen2.5-0.5B-RM' is not a local folder; download"):
        GRPOTrainer(model=tiny_model, reward_funcs="Qwen/Qwen2.5-0.5B-RM", train_dataset=rows)
    with pytest.raises(ConfigError, match=r"^train_dataset has an 'images' column, which TRL feeds to a vision-"):
        GRPOTrainer(model=tiny_model, reward_funcs="rlhf_plugins.builtin_plugins.rewards.exact_match",
                    train_dataset=[{**r, "images": ["sum.png"]} for r in rows])
    with pytest.raises(ConfigError, match=r"^eval_dataset is a dict of datasets \(sums, hard\), which TRL evaluates "):
        trainer(2, eval_dataset={"sums": held_out, "hard": held_out})
    assert len((tmp_path / "out" / "eval_dataset.jsonl").read_text().splitlines()) == 6  # nothing written over it


#: a stand-in for open-r1's reward module (open-r1 is installed from its repository, not from PyPI): the names
#: its registry maps "accuracy" and "format" to, recording what they were given
OPEN_R1_REWARDS = '''
import json, re

def accuracy_reward(completions, solution, **kwargs):
    with open("seen.jsonl", "a") as f:
        f.write(json.dumps({"prompt": kwargs["prompts"][0], "solution": solution[0]}) + "\\n")
    return [float(c[0]["content"].strip() == s) for c, s in zip(completions, solution)]

def format_reward(completions, **kwargs):
    return [float(bool(re.fullmatch(r"\\d+", c[0]["content"].strip()))) for c in completions]
'''


def test_an_open_r1_recipe_trains_with_its_prompt_column_system_prompt_and_rewards(rlhf, tmp_path, tiny_model,
                                                                                    monkeypatch):
    """open-r1's GRPO recipes are TRL files plus its own fields: its prompt column and system prompt make each
    row a conversation as its script does (the reward functions get the system message first), its reward
    names resolve to open_r1.rewards, its bookkeeping and reward-factory fields are notes, and a reward its
    script builds from its own fields is one line."""
    from rlhf_plugins.integrations.trl_config import from_trl_yaml
    from rlhf_plugins.models.tiny_model import task_rows

    (tmp_path / "open_r1").mkdir()
    (tmp_path / "open_r1" / "__init__.py").write_text("")
    (tmp_path / "open_r1" / "rewards.py").write_text(OPEN_R1_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"problem": r["prompt"], "solution": r["label"]} for r in task_rows("train")[:16]]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {"model_name_or_path": tiny_model, "model_revision": "main", "torch_dtype": "float32",
              "dataset_name": str(tmp_path / "math.jsonl"), "dataset_prompt_column": "problem",
              "system_prompt": "Answer with the number.", "reward_funcs": ["accuracy", "format"],
              "reward_weights": [1.0, 0.5], "cosine_max_len": 1000, "benchmarks": [], "callbacks": ["push_to_hub"],
              "hub_model_revision": "main", "wandb_project": "r1", "overwrite_output_dir": True, "max_steps": 2,
              "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 4,
              "learning_rate": 1e-3, "bf16": False, "use_vllm": False, "report_to": ["wandb"], "seed": 42}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    raw, notes, plugins = from_trl_yaml(tmp_path / "recipe.yaml")
    assert plugins == ["open_r1.rewards"] and raw["reward"]["functions"] == ["accuracy_reward", "format_reward"]
    assert raw["data"]["prompt_key"] == "problem" and raw["data"]["system_prompt"] == "Answer with the number."
    assert raw["data"]["template_strings"] is True  # open-r1's script makes every row a conversation
    assert any("'callbacks'" in n and "ignored" in n for n in notes)
    assert any("'wandb_project'" in n and "--log.wandb true --log.wandb_project NAME" in n for n in notes)
    assert any("cosine_max_len" in n and "rewards its script builds" in n for n in notes)
    code, _, err = rlhf("train", "--trl-config", str(tmp_path / "recipe.yaml"), "--train.progress", "false")
    assert code == 0, err
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert len(seen) == 2 and seen[0]["prompt"][0] == {"role": "system", "content": "Answer with the number."}
    assert seen[0]["prompt"][1]["role"] == "user" and seen[0]["solution"] in {r["solution"] for r in rows}
    assert [r["step"] for r in metrics_of(the_run())] == [0, 1]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "reward_funcs": ["accuracy", "cosine"]}))
    with pytest.raises(ConfigError, match="open-r1's reward 'cosine' is built by its script from cosine_"):
        from_trl_yaml(tmp_path / "recipe.yaml")


def test_trls_accuracy_reward_checks_latex_answers_with_math_verify_as_trl_calls_it(tmp_path):
    """`reward_funcs: [accuracy_reward]` (TRL's own GRPO reward for math answers): the registered function,
    called as the reward role calls it on conversational data, gives TRL's scores -- 1 for an equal boxed
    answer, 0 for another, None (the sample skipped) where the gold answer does not parse."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.integrations.trl_config import from_trl_yaml
    from rlhf_plugins.types import RewardFunction

    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(yaml.safe_dump({"reward_funcs": ["accuracy_reward"]}))
    raw, _, plugins = from_trl_yaml(cfg)
    config, pm, plan = prepare(raw, plugins, autoload=False)
    assert plan.rewards == ["accuracy_reward"]
    score = pm.components.get(RewardFunction, "accuracy_reward").build(config)
    prompts = [[{"role": "user", "content": "What is a third?"}]] * 3
    got = score(prompts=prompts, completions=[r"It is \boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", "a third"],
                solution=[r"$\frac{1}{3}$", r"$\frac{1}{3}$", "no math here"], completion_ids=[[1], [2], [3]])
    assert got == [1.0, 0.0, None]


def test_trls_accuracy_reward_without_math_verify_is_one_line_naming_the_extra(rlhf, monkeypatch):
    block_import(monkeypatch, "math_verify")
    Path("sums.jsonl").write_text('{"prompt": "1+2=", "solution": "3"}\n')
    Path("grpo.yaml").write_text(yaml.safe_dump({"reward_funcs": ["accuracy_reward"], "max_steps": 1,
                                                 "dataset_name": "sums.jsonl"}))
    code, _, err = rlhf("train", "--trl-config", "grpo.yaml")
    check_one_line_error(code, err, "reward function 'accuracy_reward' (plugin 'trl.rewards.accuracy_rewards') needs "
                                    "math_verify, which is not installed: pip install 'rlhf-plugins[math]'")


def test_partials_and_callable_instances_reward_under_the_names_trl_gives_them(tmp_path, tiny_model, monkeypatch):
    """TRL takes a ``functools.partial`` (named after its function, its bound keywords applied) and a callable
    class instance (named after its class) as reward functions; so does the drop-in, and log_history carries
    each under TRL's name (``rewards/Brief/mean``), with the scores the callables gave."""
    import functools

    from trl import GRPOConfig

    from rlhf_plugins.integrations.trl import GRPOTrainer
    from tests.helpers import samples_of

    def scaled(prompts, completions, label, scale=1.0, **kwargs):
        return [scale * (c.strip() == want) for c, want in zip(completions, label)]

    class Brief:
        def __call__(self, prompts, completions, **kwargs):
            return [0.1 if len(c) < 3 else 0.0 for c in completions]

    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(10) for b in range(10)]
    args = GRPOConfig(output_dir="out", learning_rate=1e-3, num_generations=4, per_device_train_batch_size=16,
                      max_completion_length=4, max_steps=2, use_cpu=True, bf16=False, report_to="none",
                      log_completions=True, logging_steps=1)
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=[functools.partial(scaled, scale=2.0), Brief()], args=args,
                          train_dataset=rows, rlhf={"train": {"progress": False}})
    trainer.train()
    samples = samples_of(trainer.run_dir)
    assert {r["rewards"]["scaled"] for r in samples} <= {0.0, 2.0}  # the partial's scale=2.0 applied
    assert all(r["rewards"]["brief"] == (0.1 if len(r["completion"]) < 3 else 0.0) for r in samples)
    for h in trainer.state.log_history:
        mine = [r for r in samples if r["step"] == h["step"] - 1]
        assert h["rewards/Brief/mean"] == pytest.approx(sum(r["rewards"]["brief"] for r in mine) / len(mine))
        assert h["rewards/scaled/mean"] == pytest.approx(sum(r["rewards"]["scaled"] for r in mine) / len(mine))
