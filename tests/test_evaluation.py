"""Held-out evaluation: the metrics against brute force, evaluation in the loop (split, every,
best policy, resume, its own reward, the answer-extraction hook) and ``rlhf eval``."""
from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from rlhf_plugins.evaluation.metrics import majority, pass_at_k, summarise
from tests.helpers import all_rows_of, check_one_line_error, eval_rows_of, metrics_of, the_run, with_eval

# --- sampling -------------------------------------------------------------------------------

def test_each_batch_of_held_out_prompts_draws_its_own_samples(tiny_model):
    """The same prompt in three batches of two (``--eval.batch_prompts 2``) through the transformers engine,
    which draws a call's rows from one generator of the call's seed: each batch has a seed of its own (the
    first the run's), so no batch repeats another's samples; greedy calls are unchanged."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from rlhf_plugins.api import prepare
    from rlhf_plugins.backend_data import derived_seed
    from rlhf_plugins.data.prompts import PromptSet
    from rlhf_plugins.engines.transformers_engine import TransformersEngine
    from rlhf_plugins.evaluation.evaluator import EvalSettings, Evaluator
    from rlhf_plugins.testing import backend_context

    config, pm, _ = prepare({}, autoload=False)
    engine, calls = TransformersEngine(backend_context(config, "generation", tiny_model, pm)), []

    def generate(prompt_ids, params):
        samples = engine.generate(prompt_ids, params)
        calls.append((params, [tuple(c) for c in samples.completion_ids]))
        return samples

    recorded = SimpleNamespace(generate=generate)
    prompt = list(range(40, 52))  # no task: the tiny model runs on for all 8 tokens
    held_out = PromptSet(["p"] * 6, [prompt] * 6)
    settings = EvalSettings(n_samples=2, temperature=2.0, max_new_tokens=8, batch_prompts=2, seed=3)
    evaluate = Evaluator(held_out, AutoTokenizer.from_pretrained(tiny_model), recorded,
                         lambda idx, samples, texts, step, extra: [0.0] * len(texts), lambda text, row: None, settings)
    evaluate(step=0)
    sampled = [(params, drawn) for params, drawn in calls if params.top_k == 0]
    assert [params.seed for params, _ in sampled] == [3, derived_seed(3, "eval", 2), derived_seed(3, "eval", 4)]
    drawn = [sample for _, samples in sampled for sample in samples]
    assert len(drawn) == 12 and len(set(drawn)) == 12
    assert [params.top_k for params, _ in calls].count(1) == 3  # one greedy call per batch


# --- metrics --------------------------------------------------------------------------------

def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """Every k-subset of the samples, equally likely: the share holding a correct one."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_enumeration_of_every_subset():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        c = rng.randint(0, n)
        k = rng.randint(1, n)
        outcomes = [True] * c + [False] * (n - c)
        assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12), (n, c, k)


def test_pass_at_k_hand_values_and_bad_k():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_majority_ties_go_to_the_answer_seen_first_and_none_does_not_vote():
    assert majority(["7", "5", "5", "7"]) == "7"  # 2-2 tie: 7 came first
    assert majority(["5", "7", "7", "5"]) == "5"
    assert majority([None, None, "3"]) == "3"
    assert majority([None, None]) is None
    assert majority(["1", "2", "2"]) == "2"


def test_summarise_against_hand_computed_figures():
    scores = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.5]]
    answers = [["4", "5", "5", "6"], ["9", "9", "1", "2"]]
    out = summarise(scores, answers, ["4", "9"], k=4, threshold=1.0)
    assert out["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert out["pass@4"] == 1.0
    assert out["mean@4"] == pytest.approx((0.25 + 2.5 / 4) / 2)
    assert out["maj@4"] == 0.5  # prompt 0 votes 5 (wrong), prompt 1 votes 9 (right)
    # k above n is capped; without labels there is no maj@k; a lower threshold counts the 0.5
    capped = summarise(scores, None, None, k=16, threshold=0.5)
    assert set(capped) == {"pass@1", "pass@4", "mean@4"}
    assert capped["pass@1"] == pytest.approx((1 / 4 + 3 / 4) / 2)


# --- in the loop --------------------------------------------------------------------------------

def test_eval_every_and_the_best_policy(rlhf):
    code, out, err = rlhf("train", *with_eval("--train.steps", "4", "--eval.every", "2",
                                              "--train.best_metric", "eval/pass@1", "--learner.lr", "3e-3"))
    assert code == 0, err
    run = the_run()
    evals = eval_rows_of(run)
    assert [r["step"] for r in evals] == [0, 2, 4]  # before the first step, every 2, after the last
    assert len(metrics_of(run)) == 4
    best = json.loads((run / "best.json").read_text())
    values = [r["eval/pass@1"] for r in evals]
    first_max = values.index(max(values))
    assert best == {"metric": "eval/pass@1", "value": max(values), "step": evals[first_max]["step"]}
    assert (run / "best" / "model.safetensors").is_file() and (run / "best" / "tokenizer.json").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best"] == best and summary["eval_last"]["step"] == 4
    assert f"eval after 0 steps (20 prompts): pass@1 {values[0]:.3f}" in out


def test_observers_hear_of_every_evaluation(rlhf, tmp_path):
    """``rlhf_after_eval`` gets each evaluation's step and exactly the metrics logged for it."""
    heard = tmp_path / "heard.jsonl"
    plugin = tmp_path / "listener.py"
    plugin.write_text("import json\nfrom rlhf_plugins import hookimpl\n@hookimpl\n"
                      "def rlhf_after_eval(step, metrics):\n"
                      f"    open({str(heard)!r}, 'a').write(json.dumps({{'step': step, **metrics}}) + '\\n')\n")
    code, _, err = rlhf("train", "--plugin", str(plugin), *with_eval("--train.steps", "2", "--eval.every", "1"))
    assert code == 0, err
    rows = [json.loads(line) for line in heard.read_text().splitlines()]
    assert rows == eval_rows_of(the_run()) and [r["step"] for r in rows] == [0, 1, 2]


def test_best_policy_is_the_one_that_scored_best(rlhf):
    """``rlhf eval`` of best/ reproduces the evaluation that made it best (same seeds)."""
    code, _, err = rlhf("train", *with_eval("--train.steps", "2", "--eval.every", "1", "--train.best_metric",
                                            "eval/greedy", "--train.best_mode", "min", "--train.run_name", "r"))
    assert code == 0, err
    best = json.loads(Path("runs/r/best.json").read_text())
    evals = eval_rows_of(Path("runs/r"))
    assert best["value"] == min(r["eval/greedy"] for r in evals)
    code, _, err = rlhf("eval", "--model", "runs/r/best", "--output", "best.json")
    assert code == 0, err
    report = json.loads(Path("best.json").read_text())
    row = next(r for r in evals if r["step"] == best["step"])
    assert report["metrics"] == {k.removeprefix("eval/"): v for k, v in row.items() if k != "step"}


def test_split_holds_prompts_out_of_training(rlhf, tmp_path):
    rows = [{"prompt": f"{a}+{a}=", "label": str(2 * a)} for a in range(40)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = tmp_path / "seen.txt"
    plugin = tmp_path / "spy.py"
    plugin.write_text(
        "from rlhf_plugins import hookimpl\n"
        f"SEEN = {str(seen)!r}\n"
        "@hookimpl\n"
        "def rlhf_after_rollout(step, rollout):\n"
        "    with open(SEEN, 'a') as fh:\n"
        "        fh.writelines(str(p) + '\\n' for p in rollout.prompts)\n"
        "@hookimpl\n"
        "def rlhf_extract_answer(completion, sample):\n"
        "    with open(SEEN + '.eval', 'a') as fh:\n"
        "        fh.write(sample['prompt'] + '\\n')\n"
        "    return None\n"
    )
    code, out, err = rlhf("train", "--data.path", str(data), "--reward.functions", "exact_match", "--eval.split", "0.25",
                          "--plugin", str(plugin), *with_eval("--train.steps", "10", "--train.prompts_per_step", "8"))
    assert code == 0, err
    trained = set(seen.read_text().split())
    held = set(Path(str(seen) + ".eval").read_text().split())
    assert len(held) == 10 and not trained & held  # a quarter of 40, never trained on
    assert trained | held <= {r["prompt"] for r in rows}
    assert "eval after 10 steps (10 prompts)" in out


def test_extraction_hook_decides_majority_votes(rlhf, tmp_path):
    """maj@k votes on what the hook extracts: the label itself makes every vote right, a
    constant wrong answer every vote wrong; pass@k does not depend on it."""
    figures = {}
    for name, answer in (("label", "sample['label']"), ("wrong", "'not a number'")):
        plugin = tmp_path / f"x_{name}.py"
        plugin.write_text("from rlhf_plugins import hookimpl\n@hookimpl\n"
                          f"def rlhf_extract_answer(completion, sample):\n    return {answer}\n")
        code, _, err = rlhf("train", "--plugin", str(plugin), *with_eval("--train.steps", "1", "--train.run_name", name))
        assert code == 0, err
        figures[name] = eval_rows_of(Path("runs") / name)[0]
    assert figures["label"]["eval/maj@8"] == 1.0 and figures["wrong"]["eval/maj@8"] == 0.0
    assert figures["label"]["eval/pass@1"] == figures["wrong"]["eval/pass@1"]


def test_eval_reward_functions_judge_instead_of_the_training_reward(rlhf, tmp_path):
    plugin = tmp_path / "judge.py"
    plugin.write_text("from rlhf_plugins import RewardFunction, hookimpl\n"
                      "def always(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
                      "@hookimpl\ndef rlhf_reward_functions():\n    yield RewardFunction('always', always)\n")
    code, _, err = rlhf("train", "--plugin", str(plugin), "--reward.functions", "exact_match",
                        "--eval.reward_functions", "always", *with_eval("--train.steps", "1"))
    assert code == 0, err
    run = the_run()
    assert all(r["eval/pass@1"] == 1.0 and r["eval/greedy"] == 1.0 for r in eval_rows_of(run))
    assert any(r["reward/mean"] < 1.0 for r in metrics_of(run))  # training still used exact_match


def test_resume_keeps_the_evaluations_and_the_best(rlhf):
    common = ("--eval.every", "2", "--train.best_metric", "eval/mean@8", "--train.save_every", "2")
    code, _, err = rlhf("train", *with_eval("--train.steps", "2", "--train.run_name", "r", *common))
    assert code == 0, err
    before = json.loads(Path("runs/r/best.json").read_text())
    code, _, err = rlhf("train", "--resume", "runs/r", "--train.steps", "4")
    assert code == 0, err
    evals = eval_rows_of(Path("runs/r"))
    assert [r["step"] for r in evals] == [0, 2, 4]  # the evaluation of the resumed policy is kept, not repeated
    steps = [r["step"] for r in all_rows_of(Path("runs/r")) if "reward/mean" in r]
    assert steps == [0, 1, 2, 3]
    after = json.loads(Path("runs/r/best.json").read_text())
    best_value = max(r["eval/mean@8"] for r in evals)
    assert after["value"] == best_value and (after == before or after["step"] == 4)


def test_no_eval_when_disabled_or_without_held_out_data(rlhf, tmp_path):
    code, out, err = rlhf("train", *with_eval("--train.run_name", "disabled", "--eval.enabled", "false"))
    assert code == 0, err
    assert eval_rows_of(Path("runs/disabled")) == [] and "eval after" not in out
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    code, out, err = rlhf("train", "--data.path", str(data), "--reward.functions", "exact_match",
                          *with_eval("--train.run_name", "own"))
    assert code == 0, err
    assert eval_rows_of(Path("runs/own")) == []  # own data and no --eval.path/--eval.split: nothing to hold out


# --- rlhf eval ------------------------------------------------------------------------------------

def test_rlhf_eval_reproduces_the_runs_last_evaluation(rlhf):
    code, _, err = rlhf("train", *with_eval("--train.run_name", "r"))
    assert code == 0, err
    code, out, err = rlhf("eval", "--model", "runs/r", "--output", "report.json")
    assert code == 0, err
    report = json.loads(Path("report.json").read_text())
    last = eval_rows_of(Path("runs/r"))[-1]
    assert report["metrics"] == {k.removeprefix("eval/"): v for k, v in last.items() if k != "step"}
    assert report["model"] == "runs/r/final" and report["data"] == "builtin:addition-test" and report["prompts"] == 20
    assert report["settings"]["n_samples"] == 8 and report["settings"]["reward"] == ["exact_match"]
    code, _, err = rlhf("eval", "runs/r", "--eval.n_samples", "2", "--output", "positional.json")  # as rlhf plot RUN
    assert code == 0, err
    again = json.loads(Path("positional.json").read_text())
    assert again["model"] == "runs/r/final" and again["settings"]["n_samples"] == 2
    code, _, err = rlhf("eval", "runs")  # the folder of runs, not a run: named, with what it holds
    assert code == 2 and err.strip() == ("rlhf: error: --model 'runs' is neither a run directory (config.yaml) nor a "
                                         "save_pretrained folder (config.json); it holds run directories (r); give one")


def test_rlhf_eval_on_ray_reads_the_policy_whatever_sync_the_run_saved(local_ray, rlhf):
    """An evaluation has no learner and no weight sync, whatever the run saved: a local run (``sync.method
    inprocess``, which Ray placement refuses) evaluated with ``--placement.strategy ray``, and a run trained on
    Ray (``broadcast``, under which an engine starts without weights and waits for the learner's) evaluated as
    saved, give the figures of the same policy evaluated locally (before: the first was refused with "use
    --sync.method broadcast", the second a traceback from the empty transformers engine, vLLM evaluating its
    placeholder weights at pass@1 0)."""
    import yaml

    code, _, err = rlhf("train", "--train.steps", "4", "--train.run_name", "r", "--eval.enabled", "false")
    assert code == 0, err
    code, _, err = rlhf("eval", "runs/r", "--output", "local.json")
    assert code == 0, err
    # the module's cluster started in another directory: its workers get the run's absolute path
    run = str(Path("runs/r").resolve())
    code, _, err = rlhf("eval", run, "--placement.strategy", "ray", "--output", "placed.json")
    assert code == 0, err
    saved = yaml.safe_load(Path("runs/r/config.yaml").read_text())
    assert saved["sync"]["method"] == "inprocess"
    saved["placement"]["strategy"], saved["sync"]["method"] = "ray", "broadcast"  # as a Ray run saves it
    saved["ray"]["local_num_gpus"] = 1
    Path("runs/r/config.yaml").write_text(yaml.safe_dump(saved))
    code, _, err = rlhf("eval", run, "--output", "ray.json")
    assert code == 0, err
    local, placed, ray = (json.loads(Path(f).read_text())["metrics"] for f in ("local.json", "placed.json", "ray.json"))
    assert local["greedy"] > 0.5
    for other in (placed, ray):
        assert other["greedy"] == local["greedy"] and abs(other["pass@1"] - local["pass@1"]) < 0.1


def test_rlhf_eval_refuses_an_engine_set_to_start_without_weights(rlhf):
    pytest.importorskip("vllm")
    code, _, err = rlhf("eval", "--generation.backend", "vllm", "--vllm.load_format", "dummy")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "starts without the checkpoint's weights" in err and "--vllm.load_format auto" in err
    assert not Path("eval.json").exists()


def test_rlhf_eval_of_a_lora_run_takes_its_merged_model_or_loads_its_adapter_onto_the_base(rlhf):
    """A LoRA run's final/ holds the adapter alone: ``rlhf eval`` takes its final-merged/ when there, else the
    engine loads the adapter onto the run's base model; a PEFT adapter folder outside a run goes onto the base
    its adapter_config.json names. All three evaluate the same policy; the base model alone evaluates another
    (before: a run without final-merged/ was refused, an adapter folder read as a model: 'no config.json')."""
    import shutil

    code, _, err = rlhf("train", "--lora.rank", "8", "--train.steps", "30", "--eval.enabled", "false",
                        "--lora.save_merged", "true", "--train.run_name", "merged")
    assert code == 0, err
    Path("runs/adapter").mkdir()
    shutil.copytree("runs/merged/final", "runs/adapter/final")
    shutil.copy("runs/merged/config.yaml", "runs/adapter/config.yaml")
    shutil.copytree("runs/merged/final", "peft-adapter")  # as PEFT's save_pretrained writes it, no run around it
    reports = {}
    for name, model in (("merged", "runs/merged"), ("adapter", "runs/adapter"), ("peft", "peft-adapter"),
                        ("base", None)):
        code, _, err = rlhf("eval", *(["--model", model] if model else []), "--eval.n_samples", "4",
                            "--output", f"{name}.json")
        assert code == 0, err
        reports[name] = json.loads(Path(f"{name}.json").read_text())
    assert reports["merged"]["model"] == "runs/merged/final-merged" and "adapter" not in reports["merged"]
    assert reports["adapter"]["adapter"] == "runs/adapter/final" and reports["peft"]["adapter"] == "peft-adapter"
    base = reports["base"]["model"]
    assert reports["adapter"]["model"] == reports["peft"]["model"] == base
    merged = reports["merged"]["metrics"]
    for name in ("adapter", "peft"):  # the adapter applied by PEFT on the fly rounds apart from merged weights
        assert all(abs(reports[name]["metrics"][k] - v) <= 0.05 for k, v in merged.items()), reports[name]
    assert sum(abs(reports["base"]["metrics"][k] - v) for k, v in merged.items()) > 0.1, reports["base"]


def test_rlhf_eval_of_an_adapter_naming_no_base_asks_for_one(rlhf):
    code, _, err = rlhf("train", "--lora.rank", "4", "--train.steps", "1", "--eval.enabled", "false",
                        "--train.run_name", "a")
    assert code == 0, err
    config = json.loads(Path("runs/a/final/adapter_config.json").read_text())
    Path("lone").mkdir()
    for file in Path("runs/a/final").iterdir():
        Path("lone", file.name).write_bytes(file.read_bytes())
    Path("lone/adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    code, _, err = rlhf("eval", "--model", "lone", "--output", "lone.json")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "names no base model" in err and "--model.path FOLDER" in err
    assert not Path("lone.json").exists()
    code, _, err = rlhf("eval", "--model", "lone", "--model.path", config["base_model_name_or_path"],
                        "--eval.n_samples", "2", "--output", "lone.json")
    assert code == 0, err
    assert json.loads(Path("lone.json").read_text())["adapter"] == "lone"


def test_rlhf_eval_of_a_run_trained_without_evaluations_uses_its_held_out_data(rlhf):
    code, _, err = rlhf("train", "--train.steps", "2", "--train.run_name", "quiet", "--eval.enabled", "false")
    assert code == 0, err
    code, out, err = rlhf("eval", "runs/quiet", "--eval.n_samples", "2", "--output", "quiet.json")
    assert code == 0, err
    report = json.loads(Path("quiet.json").read_text())
    assert report["data"] == "builtin:addition-test" and report["prompts"] == 20
    assert set(report["metrics"]) == {"pass@1", "pass@2", "mean@2", "maj@2", "greedy"}


def test_rlhf_eval_of_a_plain_folder_with_its_own_data_and_samples(rlhf, tiny_model, tmp_path):
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "label": str(a + 1)}) + "\n" for a in range(5)))
    code, out, err = rlhf("eval", "--model", tiny_model, "--data", str(data), "--eval.n_samples", "4",
                          "--output", str(tmp_path / "r.json"))
    assert code == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["prompts"] == 5 and set(report["metrics"]) == {"pass@1", "pass@4", "mean@4", "maj@4", "greedy"}
    assert all(0.0 <= v <= 1.0 for v in report["metrics"].values())
    assert "pass@4" in out


def test_non_terminal_progress_is_plain_periodic_lines(rlhf):
    code, out, err = rlhf("train", "--train.steps", "40", "--train.prompts_per_step", "2",
                          "--generation.n_samples_per_prompt", "2", "--eval.enabled", "false")
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == [f"{n}/40" for n in range(2, 41, 2)]  # every 5% of the run
    assert all(" reward " in line and " steps/s eta " in line and line.endswith("G") for line in lines)
    peaks = [float(line.split(" mem ")[1].rstrip("G")) for line in lines]  # one process: "0.7G"
    assert peaks == sorted(peaks) and peaks[0] > 0.1
    assert "━" not in out  # no bar drawn into a pipe


def test_a_vllm_engine_evaluating_an_adapter_starts_for_its_rank(tmp_path):
    """A bare PEFT folder carries no run config: the vLLM engine's max_lora_rank rises to the adapter's r (100:
    vLLM's 128), where it started at 64 and the adapter's load failed naming a flag to set."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.commands.evaluate import fit_lora_rank
    from rlhf_plugins.engines.vllm_lora import lora_rank_bound

    pytest.importorskip("vllm")
    config, _, plan = prepare({"generation": {"backend": "vllm"}}, autoload=False)
    adapter = {"peft_type": "LORA", "r": 100, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(adapter))
    assert lora_rank_bound(config) == 64
    fit_lora_rank(config, str(tmp_path), plan)
    assert lora_rank_bound(config) == 128
    (tmp_path / "adapter_config.json").write_text(json.dumps({**adapter, "r": 8}))
    fit_lora_rank(config, str(tmp_path), plan)  # a smaller adapter leaves the setting as it is
    assert lora_rank_bound(config) == 128


def test_an_adapter_vllm_cannot_serve_is_one_line_before_the_engine_starts(rlhf, tmp_path, monkeypatch, capsys):
    """A DoRA adapter folder (vLLM serves plain LoRA only), evaluated with vLLM: vLLM's own reason and the
    way to evaluate it, before an engine starts (it raised at the adapter's load: vLLM's LLM is watched); the
    transformers engine evaluates it."""
    vllm = pytest.importorskip("vllm")
    started = []

    class Watched(vllm.LLM):
        def __init__(self, *args, **kwargs):
            started.append(kwargs.get("model"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(vllm, "LLM", Watched)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.testing import tiny_model_path

    folder = tmp_path / "dora"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path()),
                           LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    model.save_pretrained(str(folder))
    capsys.readouterr()  # transformers' loading bar of the model above, not the command's
    code, _, err = rlhf("eval", "--model", str(folder), "--generation.backend", "vllm", "--eval.n_samples", "2")
    check_one_line_error(code, err, "vLLM cannot load this LoRA adapter (vLLM does not yet support DoRA); train "
                                    "with merged weights instead (drop --sync.method adapter), or evaluate it with "
                                    "--generation.backend transformers")
    assert started == []  # no engine was started for it
    code, _, err = rlhf("eval", "--model", str(folder), "--eval.n_samples", "2")
    assert code == 0, err
