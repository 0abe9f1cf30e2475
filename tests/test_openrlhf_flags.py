"""OpenRLHF users' flags: every flag of its five scripts (0.9's flat and 0.11's dotted spellings) is
in the table, a flag given to rlhf names our equivalent in one line, and `rlhf convert openrlhf` turns
OpenRLHF's commands into configs that rlhf accepts, carrying OpenRLHF's defaults."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from rlhf_plugins.commands.convert import convert, render
from rlhf_plugins.config.openrlhf_flags import lookup, markdown
from tests.helpers import ROOT, check_one_line_error, make_reward_model, rollout_spy, short_run

FLAGS = json.loads((Path(__file__).parent / "data" / "openrlhf_flags.json").read_text())["flags"]

#: OpenRLHF's README command (0.9 spelling) and the same in 0.11's dotted one
PPO_FLAT = """python3 -m openrlhf.cli.train_ppo_ray --ref_num_nodes 1 --ref_num_gpus_per_node 2 --reward_num_nodes 1
 --reward_num_gpus_per_node 2 --critic_num_nodes 1 --critic_num_gpus_per_node 2 --actor_num_nodes 1
 --actor_num_gpus_per_node 2 --vllm_num_engines 2 --vllm_tensor_parallel_size 1 --colocate_all_models
 --vllm_gpu_memory_utilization 0.5 --pretrain MODEL --ref_pretrain MODEL --reward_pretrain RM --save_path /tmp/out
 --micro_train_batch_size 4
 --train_batch_size 32 --micro_rollout_batch_size 8 --rollout_batch_size 8 --n_samples_per_prompt 4 --max_epochs 1
 --prompt_max_len 64 --max_samples 1000 --generate_max_len 16 --zero_stage 3 --bf16 --actor_learning_rate 5e-7
 --critic_learning_rate 9e-6 --init_kl_coef 0.01 --prompt_data DATA --input_key prompt --apply_chat_template
 --normalize_reward --gradient_checkpointing --packing_samples --vllm_sync_backend nccl --enforce_eager
 --vllm_enable_sleep --deepspeed_enable_sleep --use_wandb KEY --save_steps -1 --eval_steps -1
 --freezing_actor_steps -1""".split()
PPO_DOTTED = """python3 -m openrlhf.cli.train_ppo_ray --ref.num_nodes 1 --ref.num_gpus_per_node 2 --actor.num_nodes 1
 --actor.num_gpus_per_node 2 --vllm.num_engines 2 --train.colocate_all --actor.model_name_or_path MODEL
 --ref.model_name_or_path MODEL --reward.model_name_or_path RM --train.micro_batch_size 4 --train.batch_size 32 --rollout.batch_size 8
 --rollout.n_samples_per_prompt 4 --rollout.max_new_tokens 16 --ds.zero_stage 3 --ds.param_dtype bf16
 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 --data.prompt_dataset DATA
 --data.input_key prompt --data.apply_chat_template --reward.normalize_enable --actor.gradient_checkpointing_enable
 --algo.kl.use_loss --algo.kl.estimator k3 --actor.eps_clip_low_high 0.2 0.28""".split()


@pytest.mark.parametrize("script", sorted(FLAGS))
def test_every_flag_of_openrlhfs_scripts_is_in_the_table(script):
    missing = [flag for flag in FLAGS[script] if lookup(flag) is None]
    assert not missing, missing


def test_the_docs_table_is_the_flag_table():
    assert (ROOT / "docs" / "from_openrlhf.md").read_text() == markdown()


@pytest.mark.parametrize("args, expected", [
    (["--actor_learning_rate", "5e-7"], "--actor_learning_rate is OpenRLHF's; here it is --learner.lr;"),
    (["--actor.adam.lr", "5e-7"], "--actor.adam.lr is OpenRLHF's; here it is --learner.lr;"),
    (["--colocate_all_models"], "--colocate_all_models is OpenRLHF's; here it is --ray.colocate all;"),
    (["--pretrain", "x"], "--pretrain is OpenRLHF's; here it is --model.path"),
    (["--normalize_reward"], "--normalize_reward is OpenRLHF's; here it is --reward.model_normalize true"),
    (["--rollout_batch_size", "8"], "--rollout_batch_size is OpenRLHF's; here it is --train.prompts_per_step;"),
    (["--seed", "3"], "--seed is OpenRLHF's; here it is --train.seed;"),
    (["--use_kl_loss"], "--use_kl_loss is OpenRLHF's; here it is --algo.kl.in_reward false;"),
    (["--flash_attn"], "--flash_attn is OpenRLHF's; it has no equivalent here: transformers' default attention"),
    # its flags of two values: the second is not a stray argument
    (["--adam_betas", "0.9", "0.95"], "--adam_betas is OpenRLHF's; here it is --learner.betas;"),
    (["--critic.adam.betas", "0.9", "0.95"], "--critic.adam.betas is OpenRLHF's; here it is --critic.betas;"),
    # under a section of ours (critic), not only under one of OpenRLHF's (actor)
    (["--critic.muon.lr", "0.01"], "--critic.muon.lr is OpenRLHF's; here it is --critic.muon_lr;"),
])
def test_an_openrlhf_flag_given_to_rlhf_names_its_equivalent_in_one_line(rlhf, args, expected):
    code, _, err = rlhf("train", *args, *short_run())
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err


def test_a_close_spelling_hint_never_names_a_key_of_another_meaning(rlhf):
    code, _, err = rlhf("train", "--train.sed", "3", *short_run())
    assert code == 2 and "did you mean 'train.seed'?" in err
    code, _, err = rlhf("train", "--sead", "3", *short_run())
    assert code == 2 and "deepspeed" not in err


def _accepted(tmp_path, rlhf, tiny_model, monkeypatch, argv, command="train"):
    conv = convert(argv)
    text = render(conv).replace("MODEL", tiny_model).replace("DATA", "builtin:addition-train")
    text = text.replace("- RM", f"- {make_reward_model(tmp_path / 'rm')}")
    path = tmp_path / "converted.yaml"
    path.write_text(text)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # the user's cluster: not sized from this machine
    code, out, err = rlhf(command, "--config", str(path), "--dry-run")
    return conv, yaml.safe_load(text), code, out, err


def test_openrlhfs_readme_command_converts_to_a_config_rlhf_train_accepts(tmp_path, rlhf, tiny_model, monkeypatch):
    conv, config, code, out, err = _accepted(tmp_path, rlhf, tiny_model, monkeypatch, PPO_FLAT)
    assert code == 0, err
    assert config["learner"]["lr"] == 5e-7 and config["critic"]["lr"] == 9e-6
    assert config["model"]["reference_path"] == tiny_model  # --ref_pretrain
    assert config["ray"] == {"colocate": "all", "reference_workers": 2, "reward_workers": 2, "critic_workers": 2,
                             "actor_workers": 2}
    assert config["generation"]["backend"] == "vllm" and config["vllm"]["num_engines"] == 2
    assert config["learner"]["backend"] == "deepspeed" and config["deepspeed"]["zero_stage"] == 3
    assert (config["train"]["prompts_per_step"], config["generation"]["n_samples_per_prompt"]) == (8, 4)
    assert (config["learner"]["mini_batch_size"], config["learner"]["micro_batch_size"]) == (32, 4)
    # OpenRLHF's defaults where ours differ: GAE, KL k1 in the reward
    assert config["algo"]["advantage"]["estimator"] == "gae"
    assert config["algo"]["kl"] == {"coef": 0.01, "estimator": "k1", "in_reward": True}
    assert config["data"]["max_samples"] == 1000 and "--max_samples" not in dict(conv.skipped)
    assert "--micro_rollout_batch_size" in dict(conv.skipped)
    # OpenRLHF's -1 (never on the way) is our 0 (at the end only), which the config accepts
    assert config["train"]["save_every"] == 0 and config["eval"]["every"] == 0
    assert config["critic"]["freezing_steps"] == 0
    assert "config is valid" in out


def test_the_dotted_spelling_converts_the_same(tmp_path, rlhf, tiny_model, monkeypatch):
    conv, config, code, out, err = _accepted(tmp_path, rlhf, tiny_model, monkeypatch, PPO_DOTTED)
    assert code == 0, err
    assert config["learner"]["lr"] == 5e-7 and config["model"]["dtype"] == "bfloat16"
    assert config["model"]["reference_path"] == tiny_model  # --ref.model_name_or_path
    assert config["algo"]["kl"]["in_reward"] is False and config["algo"]["kl"]["estimator"] == "k3"
    assert (config["algo"]["policy_loss"]["clip_low"], config["algo"]["policy_loss"]["clip_high"]) == (0.2, 0.28)
    assert config["ray"]["actor_workers"] == 2 and config["ray"]["colocate"] == "all"


def test_an_sft_command_converts_to_rlhf_sft(tmp_path, rlhf, tiny_model, monkeypatch):
    argv = ("deepspeed --module openrlhf.cli.train_sft --pretrain MODEL --dataset DATA --input_key prompt "
            "--output_key answer --max_len 128 --learning_rate 5e-6 --max_epochs 2 --micro_train_batch_size 4 "
            "--zero_stage 2 --bf16 --lora_rank 8").split()
    conv = convert(argv)
    assert conv.command == "sft"
    # OpenRLHF's defaults carried: the global batch (128) as TRL's per-device batch x accumulation steps,
    # cosine decay to a tenth after a 3% warm-up, Adam betas (0.9, 0.95)
    assert conv.raw["trl"] == {"max_length": 128, "learning_rate": 5e-6, "num_train_epochs": 2,
                               "per_device_train_batch_size": 4, "gradient_accumulation_steps": 32,
                               "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
                               "warmup_steps": 0.03, "adam_beta1": 0.9, "adam_beta2": 0.95}
    assert any(c.startswith("--train_batch_size 128 (128 samples per optimizer step: 4 per device x 32")
               for c in conv.carried)
    assert conv.raw["lora"]["rank"] == 8 and conv.raw["model"]["dtype"] == "bfloat16"
    assert "--zero_stage" in dict(conv.skipped)
    text = render(conv).replace("MODEL", tiny_model).replace("path: DATA", "path: null")
    text = text.replace("  prompt_key: prompt\n", "").replace("  completion_key: answer\n", "")
    (tmp_path / "sft.yaml").write_text(text)
    code, out, err = rlhf("sft", "--config", str(tmp_path / "sft.yaml"), "--dry-run")
    assert code == 0, err


def test_a_stages_global_batch_and_logging_steps_reach_trl(tmp_path, rlhf, monkeypatch):
    """--train_batch_size is OpenRLHF's global batch: TRL's per-device batch (--micro_train_batch_size,
    or TRL's 8) times gradient_accumulation_steps; --logging_steps is TRL's for a stage."""
    dpo = convert("python -m openrlhf.cli.train_dpo --pretrain M --train_batch_size 64 --micro_train_batch_size 2 "
                  "--logging_steps 1".split())
    assert (dpo.raw["trl"]["per_device_train_batch_size"], dpo.raw["trl"]["gradient_accumulation_steps"]) == (2, 32)
    assert dpo.raw["trl"]["logging_steps"] == 1 and "--logging_steps" not in dict(dpo.skipped)
    assert "64 samples per optimizer step: 2 per device x 32" in dict(dpo.partial)["--train_batch_size"]
    rm = convert("python -m openrlhf.cli.train_rm --pretrain M --train_batch_size 32".split())
    assert (rm.raw["trl"]["per_device_train_batch_size"], rm.raw["trl"]["gradient_accumulation_steps"]) == (8, 4)
    ppo = convert("--pretrain M --train_batch_size 64 --logging_steps 1".split())
    assert ppo.raw["learner"]["mini_batch_size"] == 64 and "trl" not in ppo.raw  # rlhf train: ours, unchanged
    assert "--logging_steps" in dict(ppo.skipped)


STAGE_FLAGS = ("--pretrain MODEL --max_len 64 --train_batch_size 16 --micro_train_batch_size 4 --max_epochs 1 "
               "--learning_rate 1e-3 --save_steps -1 --eval_steps -1 --logging_steps 1 --max_ckpt_num 3 "
               "--lr_warmup_ratio 0.05 --lr_scheduler cosine_with_min_lr --zero_stage 2 --l2 0 --max_norm 1.0")


@pytest.mark.parametrize("stage, extra", [
    ("sft", "--dataset DATA --input_key question --output_key answer --adam_betas 0.9 0.95"),
    ("rm", "--dataset DATA --prompt_key prompt --chosen_key chosen --rejected_key rejected --loss sigmoid"),
    ("dpo", "--dataset DATA --prompt_key prompt --chosen_key chosen --rejected_key rejected --beta 0.1 "
            "--nll_loss_coef 0.2 --label_smoothing 0 --ref_pretrain MODEL"),
])
def test_openrlhfs_stage_commands_convert_to_configs_their_stage_runs(tmp_path, rlhf, tiny_model, stage, extra):
    """What OpenRLHF's stage scripts pass (checkpoint counts, warm-up ratios, the RPO weight) converts to
    fields the installed TRL has: each config is accepted, and the DPO one trains (RPO as TRL's loss list)."""
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b), "prompt": f"{a}+{b}=", "chosen": str(a + b),
             "rejected": str(a + b + 1)} for a in range(4) for b in range(4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    conv = convert(f"python -m openrlhf.cli.train_{stage} {STAGE_FLAGS} {extra}".split())
    trl = conv.raw["trl"]
    assert (trl["per_device_train_batch_size"], trl["gradient_accumulation_steps"], trl["warmup_steps"]) == (4, 4, 0.05)
    assert trl["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1} and "--max_ckpt_num" in dict(conv.skipped)
    if stage == "dpo":
        assert (trl["loss_type"], trl["loss_weights"]) == (["sigmoid", "sft"], [1.0, 0.2])
        assert conv.raw["model"]["reference_path"] == "MODEL"  # --ref_pretrain: DPO's reference
    (tmp_path / "c.yaml").write_text(render(conv).replace("MODEL", tiny_model).replace("DATA", "data.jsonl"))
    code, out, err = rlhf(stage, "--config", "c.yaml", *(["--dry-run"] if stage != "dpo" else []))
    assert code == 0, err
    if stage == "dpo":
        assert "model saved to" in out.replace("\n", " ")


def test_a_serve_rm_command_converts_to_the_rlhf_serve_reward_line_it_parses_to():
    import shlex

    from rlhf_plugins.cli import build_parser

    conv = convert("python -m openrlhf.cli.serve_rm --reward_pretrain /models/rm --port 5000 --bf16 --flash_attn "
                   "--normalize_reward --value_head_prefix score --max_len 8192 --batch_size 16".split())
    text = render(conv)
    assert text.startswith("# rlhf serve-reward   (converted") and "--config" not in text
    line = text.strip().splitlines()[-1]
    args = build_parser().parse_args(shlex.split(line)[1:])
    assert (args.model, args.port, args.dtype, args.normalize_reward, args.batch_size) == \
        ("/models/rm", 5000, "bfloat16", True, 16)
    assert {"--flash_attn", "--value_head_prefix", "--max_len"} == set(dict(conv.skipped))


def test_convert_writes_its_file_with_o_before_the_command_line_as_documented(tmp_path, rlhf):
    code, out, err = rlhf("convert", "openrlhf", "-o", "ppo.yaml", "--", "python3", "-m",
                          "openrlhf.cli.train_ppo_ray", "--pretrain", "M", "--actor_learning_rate", "5e-7")
    assert code == 0, err
    assert "wrote ppo.yaml" in out and "learner:" not in out
    config = yaml.safe_load((tmp_path / "ppo.yaml").read_text())
    assert config["learner"]["lr"] == 5e-7 and config["model"]["path"] == "M"
    code, _, err = rlhf("convert", "openrlhf", "-o", "--", "--pretrain", "M")
    assert code == 2 and "-o needs a file name" in err and [p.name for p in tmp_path.glob("*.yaml")] == ["ppo.yaml"]


@pytest.mark.parametrize("module, name, hint", [
    ("openrlhf.cli.train_kto", "train_kto", "; it left OpenRLHF in 0.9: rlhf kto runs TRL's KTOTrainer, with TRL's "
                                            "fields under --trl.*"),
    ("/src/OpenRLHF/openrlhf/cli/train_prm.py", "train_prm", ""),
    ("openrlhf.cli.train_kd", "train_kd", "; it left OpenRLHF in 0.9: rlhf distill distils on the student's own "
                                          "samples (TRL's on-policy distillation), not on the dataset's answers"),
    # OpenRLHF 0.11's on-policy distillation: the recipe docs/algorithms.md measures
    ("openrlhf.cli.train_opd", "train_opd", "; its sampled-token mode (--opd.topk 0) has a counterpart in rlhf "
                                            "train: the teacher as --model.reference_path and its KL as the reward (--reward.weights 0 "
                                            "--algo.kl.in_reward true --algo.kl.estimator k1 --algo.kl.coef 1; "
                                            "docs/algorithms.md), its top-k mode nearest to rlhf distill "
                                            "--model.teacher (TRL's divergence over the whole vocabulary)"),
    ("openrlhf.cli.train_ppo", "train_ppo", "; it is OpenRLHF's PPO without Ray, whose flags train_ppo_ray shares: "
                                            "convert the command with openrlhf.cli.train_ppo_ray in its place "
                                            "(train_ppo_ray's defaults are carried where it gives none; "
                                            "--placement.strategy local runs it in one process)")])
def test_an_openrlhf_command_without_an_equivalent_is_one_line_not_a_ppo_config(tmp_path, rlhf, module, name, hint):
    """A command this project does not convert (KTO, process reward models, off-policy distillation) was read as
    train_ppo_ray and written as a PPO config; it is one line naming the commands that convert (and the stage
    nearest to it), and writes nothing."""
    code, out, err = rlhf("convert", "openrlhf", "-o", "kto.yaml", "--", "python3", "-m", module, "--pretrain", "M",
                          "--beta", "0.1")
    check_one_line_error(code, err, f"OpenRLHF's {name} has no equivalent here: rlhf convert openrlhf converts "
                                    "train_ppo_ray, train_sft, train_rm, train_dpo, serve_rm (docs/from_openrlhf.md)"
                                    + hint)
    assert err.strip().endswith(hint or "(docs/from_openrlhf.md)")
    assert out == "" and not list(tmp_path.glob("*.yaml"))


def test_input_template_and_max_samples_shape_the_prompts_the_engine_gets(rlhf, tmp_path, tiny_model):
    """OpenRLHF's --input_template puts each plain prompt at its {} (the chat template off, as there)
    and --max_samples keeps the first rows, off which the held-out split is then taken."""
    from transformers import AutoTokenizer

    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+1", "label": str(a + 1)}) + "\n" for a in range(10)))
    plugin, seen = rollout_spy(tmp_path)
    template = "Q: {} =\nA:"
    code, _, err = rlhf("train", "--plugin", str(plugin), "--data.path", str(path), "--data.apply_chat_template",
                        "false", "--data.input_template", template, "--data.max_samples", "4", "--reward.functions",
                        "exact_match", *short_run("--eval.enabled", "true", "--eval.split", "0.25"))
    assert code == 0, err
    steps = seen()
    prompts = {p for step_prompts, _ in steps for p in step_prompts}
    first_four = {template.format(f"{a}+1") for a in range(4)}
    assert prompts < first_four and len(prompts) == 3  # one of the four held out, rows 5-10 never used
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for step_prompts, ids in steps:
        assert ids == [tok(p)["input_ids"] for p in step_prompts]


def test_stage_rows_take_the_input_template_and_max_samples(tmp_path):
    from rlhf_plugins.errors import DataError
    from rlhf_plugins.stages.config import StageConfig, StageData
    from rlhf_plugins.stages.data import load

    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+1", "completion": str(a + 1)}) + "\n" for a in range(10)))
    cfg = StageConfig(data=StageData(path=str(path), input_template="User: {}\nAssistant: ", max_samples=5,
                                     eval_split=0.2))
    train, held, _ = load("sft", cfg)
    assert len(train) + len(held) == 5 and len(held) == 1
    assert {r["prompt"]: r["completion"] for r in train + held} == \
        {f"User: {a}+1\nAssistant: ": str(a + 1) for a in range(5)}  # the first five rows, each in place
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant",
                                                                                  "content": "2"}]}) + "\n")
    cfg = StageConfig(data=StageData(path=str(chat), input_template="Q: {}"))
    with pytest.raises(DataError, match="drop --data.input_template"):
        load("sft", cfg)


def test_openrlhfs_dataset_list_and_probs_convert_to_a_mixture_rlhf_accepts(tmp_path, rlhf, tiny_model, monkeypatch):
    argv = ["python3", "-m", "openrlhf.cli.train_ppo_ray", "--pretrain", "MODEL", "--prompt_data",
            "builtin:addition-train,builtin:addition-test", "--prompt_data_probs", "0.3,0.7", "--max_samples", "50",
            "--input_template", "Q: {}\nA: "]
    conv, config, code, out, err = _accepted(tmp_path, rlhf, tiny_model, monkeypatch, argv)
    assert code == 0, err
    assert config["data"]["path"] == "builtin:addition-train,builtin:addition-test"
    assert [float(p) for p in str(config["data"]["probs"]).strip("[]").split(",")] == [0.3, 0.7]
    assert config["data"]["max_samples"] == 50 and config["data"]["input_template"] == "Q: {}\nA: "
    assert config["data"]["apply_chat_template"] is False  # OpenRLHF's default, where the template applies
    assert not {"--prompt_data_probs", "--max_samples", "--input_template"} & set(dict(conv.skipped))


REWARD_FUNC = '''
import torch

def reward_func(queries, prompts, labels):
    return torch.tensor([1.0 if q.endswith(label) else 0.0 for q, label in zip(queries, labels)])
'''


def test_a_reward_func_file_given_as_remote_rm_url_becomes_the_runs_reward(tmp_path, monkeypatch):
    """OpenRLHF's GRPO recipe passes a local reward_func(queries, prompts, labels) file as --remote_rm_url:
    the converted config loads it as a plugin and scores with its reward_func, labels from --label_key."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.training.reward_role import RewardBatch, RewardRole

    (tmp_path / "reward_func.py").write_text(REWARD_FUNC)
    monkeypatch.chdir(tmp_path)
    conv = convert(["--pretrain", "m", "--remote_rm_url", "reward_func.py", "--label_key", "answer",
                    "--advantage_estimator", "group_norm"])
    raw = yaml.safe_load(render(conv))
    assert raw["plugins"] == ["reward_func.py"] and raw["reward"]["functions"] == ["reward_func"]
    assert "remote_urls" not in raw["reward"] and "--remote_rm_url" in dict(conv.partial)
    cfg, pm, plan = prepare({"reward": raw["reward"], "data": raw["data"], "plugins": raw["plugins"]}, autoload=False)
    assert plan.rewards == ["reward_func"] and cfg.data.label_key == "answer"
    role = RewardRole(cfg, pm.spec, plan.rewards, plan.weights)
    scores = role.score(RewardBatch(["1+1=", "2+2="], ["2", "5"], [[1], [2]], {"label": ["2", "4"]})).scores
    assert scores == [1.0, 0.0]
    both = convert(["--remote_rm_url", "http://127.0.0.1:5000/get_reward,reward_func.py"])
    assert both.raw["reward"]["remote_urls"] == ["http://127.0.0.1:5000/get_reward"]
    assert both.raw["plugins"] == ["reward_func.py"]


def _their_weights(old, rollout, mask, level, mode, gating, low, high):
    """OpenRLHF's token weights of its off-policy correction, written from its loss: a statistic per unit (the
    ratio pi_old / pi_rollout, or the sampled token's binary KL / total variation; at seq level the ratio's
    geometric mean or the divergence's mean), clamped into [low, high] (clip) or gating the raw token ratio (mask).
    0.9's tis is token clip, icepop token mask, seq-mask-tis seq mask."""
    log_ratio = old - rollout
    seq = level == "seq"

    def seq_mean(x):
        return ((x * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1)

    if gating == "ratio":
        stat = (seq_mean(log_ratio) if seq else log_ratio).exp()
    else:
        p, q = rollout.exp().clamp(1e-6, 1 - 1e-6), old.exp().clamp(1e-6, 1 - 1e-6)
        if gating == "binary_kl":
            stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
        else:
            stat = (p - q).abs()
        stat = seq_mean(stat) if seq else stat
    if mode == "clip":
        return stat.clamp(min=low, max=high).expand_as(old) * mask
    keep = (stat >= low) & (stat <= high)
    return torch.where(keep, log_ratio.exp(), 0.0) * mask


@pytest.mark.parametrize("flags, scheme", [
    ("--enable_vllm_is_correction", ("token", "clip", "ratio", 0.5, 5.0)),
    ("--enable_vllm_is_correction --vllm_is_truncated_threshold 0.8 1.25", ("token", "clip", "ratio", 0.8, 1.25)),
    ("--enable_vllm_is_correction --vllm_is_truncated_threshold 2", ("token", "clip", "ratio", 0.0, 2.0)),
    ("--enable_vllm_is_correction --vllm_is_correction_type icepop --vllm_is_truncated_threshold 0.5 2",
     ("token", "mask", "ratio", 0.5, 2.0)),
    ("--enable_vllm_is_correction --use_icepop", ("token", "mask", "ratio", 0.5, 5.0)),
    ("--enable_vllm_is_correction --vllm_is_correction_type seq-mask-tis --vllm_is_truncated_threshold 0.8 1.2",
     ("seq", "mask", "ratio", 0.8, 1.2)),
    ("--algo.advantage.is_correction_level token", ("token", "mask", "ratio", 0.5, 5.0)),
    ("--algo.advantage.is_correction_level token --algo.advantage.is_correction_mode clip "
     "--algo.advantage.is_correction_threshold 0.9 1.1", ("token", "clip", "ratio", 0.9, 1.1)),
    ("--algo.advantage.is_correction_level seq --algo.advantage.is_correction_threshold 0.8 1.2",
     ("seq", "mask", "ratio", 0.8, 1.2)),
    ("--algo.advantage.is_correction_level token --algo.advantage.is_correction_gating binary_kl "
     "--algo.advantage.is_correction_threshold 0.02", ("token", "mask", "binary_kl", 0.0, 0.02)),
    ("--algo.advantage.is_correction_level seq --algo.advantage.is_correction_gating binary_kl "
     "--algo.advantage.is_correction_threshold 5e-3", ("seq", "mask", "binary_kl", 0.0, 5e-3)),
    ("--algo.advantage.is_correction_level seq --algo.advantage.is_correction_gating tv "
     "--algo.advantage.is_correction_threshold 0 0.05", ("seq", "mask", "tv", 0.0, 0.05)),
    ("--algo.advantage.is_correction_level token --algo.advantage.is_correction_gating tv "
     "--algo.advantage.is_correction_threshold 0.05", ("token", "mask", "tv", 0.0, 0.05)),
])
def test_openrlhfs_off_policy_correction_converts_to_the_same_token_weights(flags, scheme):
    """Both generations of OpenRLHF's correction flags give our mismatch correction the weights OpenRLHF's loss
    computes, on random engine / learner log-probs whose ratios span e^-1.5 .. e^1.5 (before: 0.9's two-value
    band was read as one bound, its TIS had no floor, seq-mask-tis capped the kept ratios, the dotted seq level
    and the binary_kl / tv gates were not converted)."""
    from types import SimpleNamespace

    from rlhf_plugins.algorithms.mismatch import weights_for
    from rlhf_plugins.config.algo_schema import PolicyLossConfig

    options = SimpleNamespace(**{**vars(PolicyLossConfig()),
                                 **convert(["--pretrain", "m", *flags.split()]).raw["algo"]["policy_loss"]})
    g = torch.Generator().manual_seed(7)
    old = torch.rand(64, 12, generator=g, dtype=torch.float64).clamp(0.02, 0.98).log()
    rollout = old + torch.randn(64, 12, generator=g, dtype=torch.float64) * torch.rand(64, 1, generator=g) * 0.5
    rollout = rollout.clamp(max=0.0)
    lengths = torch.randint(3, 13, (64, 1), generator=g)
    mask = (torch.arange(12) < lengths).to(torch.float64)
    ours, metrics = weights_for(options, old, rollout, mask)
    theirs = _their_weights(old, rollout, mask, *scheme)
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)
    real = mask > 0
    if scheme[1] == "mask":  # the gate dropped some tokens, not all, and the metric counts them
        dropped = float((theirs[real] == 0).double().mean())
        assert 0.0 < dropped < 1.0 and float(metrics["mismatch/dropped_frac"]) == pytest.approx(dropped)
    else:  # the band clamped some weights
        assert (theirs[real] != (old - rollout).exp()[real]).any()


@pytest.mark.parametrize("flags, skipped, why", [
    ("--algo.advantage.is_correction_level geo", "--algo.advantage.is_correction_level",
     "'geo' is not one of OpenRLHF's off, token, seq"),
    ("--algo.advantage.is_correction_level token --algo.advantage.is_correction_mode trunc",
     "--algo.advantage.is_correction_mode", "'trunc' is not one of OpenRLHF's mask, clip"),
    ("--algo.advantage.is_correction_level seq --algo.advantage.is_correction_mode clip",
     "--algo.advantage.is_correction_mode", "OpenRLHF refuses this combination too"),
    ("--algo.advantage.is_correction_level token --algo.advantage.is_correction_gating tv",
     "--algo.advantage.is_correction_gating", "OpenRLHF refuses the band 0.5 5.0 too"),
    ("--vllm_is_correction_type icepop", "--vllm_is_correction_type", "no effect without --enable_vllm_is_correction"),
])
def test_an_off_policy_correction_with_no_equivalent_is_listed_not_converted(flags, skipped, why):
    conv = convert(["--pretrain", "m", *flags.split()])
    assert "mismatch" not in conv.raw.get("algo", {}).get("policy_loss", {})
    assert any(flag == skipped and why in reason for flag, reason in conv.skipped), conv.skipped


def test_no_advantage_std_norm_keeps_the_estimator_and_drops_the_batch_std():
    """OpenRLHF's --no_advantage_std_norm leaves gae / reinforce / reinforce_baseline in place and whitens
    their advantages by the batch mean alone (before: it turned any estimator into dr_grpo -- a GAE run
    lost its critic)."""
    for estimator in ("gae", "reinforce_baseline"):
        for order in ((0, 1), (1, 0)):
            parts = [["--advantage_estimator", estimator], ["--no_advantage_std_norm"]]
            raw = convert(["--pretrain", "m", *parts[order[0]], *parts[order[1]]]).raw
            assert raw["algo"]["advantage"]["estimator"] == estimator and raw["algo"]["advantage"]["std_norm"] is False


@pytest.mark.parametrize("flags, skipped, kept", [
    # OpenRLHF's example train_disco_ray_hybrid_engine.sh names an estimator no release of it takes
    ("--advantage_estimator disco", "--advantage_estimator", ("algo.advantage.estimator", "gae")),
    ("--lr_scheduler cosine_with_restarts", "--lr_scheduler", ("learner.lr_scheduler", "cosine")),
    ("--actor.optim adamw_8bit", "--actor.optim", ("learner.optimizer", None)),
])
def test_a_value_without_an_equivalent_is_listed_not_carried_into_the_config(flags, skipped, kept):
    """A value of a flag whose values are mapped one by one and that has none here is listed as not
    converted, naming the values that are, and the config keeps the default (it carried the value, which
    rlhf train then refused); a special value's map (-1) still carries any other value as it is."""
    conv = convert(["--pretrain", "m", *flags.split()])
    why = next(reason for flag, reason in conv.skipped if flag == skipped)
    assert why.startswith(f"{flags.split()[1]} has no equivalent here (converted: ") and "keeps the default" in why
    section, _, key = kept[0].rpartition(".")
    node = conv.raw
    for part in section.split("."):
        node = node.get(part, {})
    assert node.get(key) == kept[1]
    assert convert(["--pretrain", "m", "--eval_steps", "7"]).raw["eval"]["every"] == 7  # an open map
    assert convert(["--pretrain", "m", "--eval_steps", "-1"]).raw["eval"]["every"] == 0


def test_freezing_the_actor_without_a_critic_is_listed_not_converted():
    conv = convert(["--pretrain", "m", "--advantage_estimator", "group_norm", "--freezing_actor_steps", "5",
                    "--n_samples_per_prompt", "4"])
    assert "freezing_steps" not in conv.raw.get("critic", {})
    assert any(flag == "--freezing_actor_steps" and "no critic" in why for flag, why in conv.skipped)
    assert convert(["--pretrain", "m", "--freezing_actor_steps", "5"]).raw["critic"]["freezing_steps"] == 5  # gae


def test_the_actors_and_the_critics_optimizer_flags_each_reach_its_own_learner():
    """0.11's --actor.* and --critic.* optimizer flags set each learner's own (they were one pair: the later
    flag won for both); one given for the actor alone leaves the critic at OpenRLHF's default, whatever the
    order; 0.9's flat spelling is both learners' (the critic takes the learner's)."""
    from rlhf_plugins.config.loading import build_config

    conv = convert(["--critic_pretrain", "C", "--critic.adam.betas", "0.8", "0.99", "--actor.adam.betas", "0.9", "0.98",
                    "--actor.max_norm", "2", "--critic.max_norm", "5", "--actor.adam.eps", "1e-6",
                    "--critic.lr_scheduler", "constant", "--critic.lr_warmup_ratio", "0"])
    assert [flag for flag, _ in conv.partial] == ["--critic.lr_scheduler"]  # its warm-up is a flag of its own
    config = build_config({k: conv.raw[k] for k in ("learner", "critic")})  # the sections of the plugins aside
    actor, critic = config.learner_of("actor"), config.learner_of("critic")
    assert (actor.betas, actor.max_grad_norm, actor.eps, actor.lr_scheduler, actor.warmup_ratio) == (
        [0.9, 0.98], 2, 1e-6, "cosine", 0.03)  # the last two: OpenRLHF's defaults, carried
    assert (critic.betas, critic.max_grad_norm, critic.eps, critic.lr_scheduler, critic.warmup_ratio) == (
        [0.8, 0.99], 5, 1e-8, "constant", 0.0)
    muon = convert(["--critic_pretrain", "C", "--actor.optim", "muon"]).raw  # the critic stays on OpenRLHF's Adam
    assert (muon["learner"]["optimizer"], muon["critic"]["optimizer"]) == ("muon", "adamw")
    flat = convert(["--adam_betas", "0.9", "0.98", "--max_norm", "3", "--l2", "0.01"]).raw
    flat = build_config({k: flat[k] for k in ("learner", "critic")})
    assert flat.learner_of("critic") is flat.learner
    assert (flat.learner.betas, flat.learner.max_grad_norm, flat.learner.weight_decay) == ([0.9, 0.98], 3, 0.01)


def test_stop_properly_penalty_scales_truncated_scores_as_there():
    """ProRL's --stop_properly_penalty_coef 0.0 (OpenRLHF's recipes) zeroes a truncated sample's reward
    (before: it became a penalty of 0 subtracted -- no penalty at all)."""
    reward = convert(["--pretrain", "m", "--stop_properly_penalty_coef", "0.0"]).raw["reward"]
    assert reward["truncated_scale"] == 0.0 and "stop_penalty" not in reward


def test_async_training_with_the_correction_turned_off_trains_uncorrected_as_there(tmp_path):
    """``--async_train`` alone converts with a correction (tis); with the correction level set to off, as
    OpenRLHF then trains on stale samples uncorrected, and the config is one rlhf accepts."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.testing import tiny_model_path

    argv = ["--pretrain", tiny_model_path(), "--async_train", "--reward_pretrain", "RM", "--n_samples_per_prompt", "4"]
    assert convert(argv).raw["algo"]["policy_loss"]["mismatch"] == "tis"
    raw = convert([*argv, "--algo.advantage.is_correction_level", "off"]).raw
    assert raw["algo"]["policy_loss"]["mismatch"] == "none" and raw["train"]["allow_uncorrected_staleness"] is True
    raw["reward"] = {"functions": ["exact_match"]}
    config, _, _ = prepare(raw, autoload=False)
    assert config.train.max_staleness == 1 and config.algo.policy_loss.mismatch == "none"


def test_notes_name_the_spelling_the_command_line_used():
    """A note about a flag read by hand names it as typed: the dotted spelling of later releases, not 0.9's."""
    conv = convert(["--pretrain", "m", "--reward.remote_url", "reward.py", "--actor.policy_loss_type", "gspo",
                    "--algo.advantage.is_correction_enable", "--freezing_actor_steps", "3",
                    "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4"])
    assert {"--reward.remote_url", "--algo.advantage.is_correction_enable"} <= {flag for flag, _ in conv.partial}
    assert [flag for flag, _ in conv.skipped] == ["--freezing_actor_steps"]


@pytest.mark.parametrize("flags", ["--enable_vllm_is_correction --vllm_is_correction_type icepop",
                                   "--algo.advantage.is_correction_level token"])
def test_a_correction_under_gspo_takes_gspos_ratio_against_the_engine_as_there(flags):
    """OpenRLHF under gspo weighs nothing and measures the sequence ratio against the engine's log-probs
    (``log_probs - rollout_log_probs``), clipped as usual: converted, our objective gives its loss and gradient
    on random log-probs (before: listed as not converted, the run then trained against the learner's old ones)."""
    from rlhf_plugins.algorithms import policy_losses
    from rlhf_plugins.algorithms.objective import Objective
    from rlhf_plugins.api import prepare

    raw = convert(["--pretrain", "m", "--policy_loss_type", "gspo", *flags.split()]).raw
    assert raw["algo"]["policy_loss"]["mismatch"] == "engine_ratio"
    config, _, _ = prepare({"algo": {"policy_loss": {**raw["algo"]["policy_loss"], "clip_low": 0.05,
                                                     "clip_high": 0.05}}}, autoload=False)
    g = torch.Generator().manual_seed(4)
    old = torch.randn(6, 5, generator=g, dtype=torch.float64) - 1
    rollout = old + torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.1
    logprobs = (old + torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.05).requires_grad_(True)
    mask = (torch.arange(5) < torch.tensor([5, 3, 4, 2, 5, 1])[:, None]).to(torch.float64)
    advantages = torch.randn(6, 1, generator=g, dtype=torch.float64).expand(6, 5) * mask
    objective = Objective(policy_losses.gspo, config.algo.policy_loss)
    ours, metrics = objective({"logprobs": logprobs}, {"old_logprobs": old, "rollout_logprobs": rollout,
                                                       "advantages": advantages, "action_mask": mask})
    ratio = (((logprobs - rollout) * mask).sum(-1) / mask.sum(-1)).exp()[:, None] * mask  # OpenRLHF's gspo
    surr = torch.min(ratio * advantages, ratio.clamp(0.95, 1.05) * advantages)
    theirs = (-(surr * mask).sum(-1) / mask.sum(-1)).mean()  # gspo's per-sample mean
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    grad_ours, = torch.autograd.grad(ours, logprobs, retain_graph=True)
    grad_theirs, = torch.autograd.grad(theirs, logprobs)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-9, atol=1e-12)
    assert 0 < float(metrics["loss/clip_frac"]) < 1 and float(metrics["mismatch/abs_log_ratio"]) > 0.01


def test_openrlhfs_flash_reinforce_recipe_converts_to_ours():
    """OpenRLHF's FlashREINFORCE line (one rollout per prompt, the batch's baseline, the binary-KL sequence trust
    region at 5e-3, sample-mean aggregation, no KL) converts to docs/algorithms.md's recipe, every flag used."""
    conv = convert(["--pretrain", "m", "--rollout.n_samples_per_prompt", "1", "--algo.advantage.estimator",
                    "flash_reinforce", "--algo.advantage.is_correction_level", "seq",
                    "--algo.advantage.is_correction_gating", "binary_kl", "--algo.advantage.is_correction_threshold",
                    "5e-3", "--actor.loss_agg_mode", "seq-mean-token-mean", "--algo.kl.init_coef", "0"])
    algo = conv.raw["algo"]
    assert algo["advantage"]["estimator"] == "batch_mean" and "std_eps" not in algo["advantage"]
    assert {k: algo["policy_loss"][k] for k in ("mismatch", "mismatch_gate", "mismatch_max_divergence",
                                                "aggregation")} == {
        "mismatch": "seq_icepop", "mismatch_gate": "binary_kl", "mismatch_max_divergence": 5e-3,
        "aggregation": "seq-mean-token-mean"}
    assert algo["kl"]["coef"] == 0 and conv.raw["generation"]["n_samples_per_prompt"] == 1
    assert not conv.skipped


def test_openrlhfs_checkpoint_count_is_carried_and_its_flag_overrides_it():
    """OpenRLHF keeps its 3 newest checkpoints (--ckpt.max_num, 0.9's --max_ckpt_num); ours keeps 2 by default."""
    assert convert(["--pretrain", "m", "--save_steps", "10"]).raw["train"]["keep_checkpoints"] == 3
    assert convert(["--pretrain", "m", "--ckpt.max_num", "5"]).raw["train"]["keep_checkpoints"] == 5
    from rlhf_plugins.config.loading import build_config

    assert build_config({}).train.keep_checkpoints == 2  # so the carried default is a change


@pytest.mark.parametrize("stage, lr, epochs, max_len", [("sft", 5e-6, 2, 2048), ("rm", 9e-6, 1, 512),
                                                         ("dpo", 1e-5, 1, 512)])
def test_a_stage_command_without_lr_epochs_or_length_trains_with_openrlhfs(stage, lr, epochs, max_len):
    """Each OpenRLHF stage script's own learning rate, epochs and --max_len (TRL's differ: 2e-5 / 1e-4 / 1e-6,
    3 epochs, and the stage's 256-token bound would cut an SFT sample of 2048): carried where not given."""
    bare = convert(f"python -m openrlhf.cli.train_{stage} --pretrain M --dataset D".split())
    trl = bare.raw["trl"]
    assert (trl["learning_rate"], trl["num_train_epochs"], trl["max_length"]) == (lr, epochs, max_len)
    assert {f"--max_epochs {epochs}", f"--max_len {max_len}", f"--learning_rate {lr:g}"} <= set(bare.carried)
    given = convert(f"python -m openrlhf.cli.train_{stage} --pretrain M --dataset D --max_len 64 --max_epochs 3 "
                    "--learning_rate 1e-4".split()).raw["trl"]
    assert (given["learning_rate"], given["num_train_epochs"], given["max_length"]) == (1e-4, 3, 64)
