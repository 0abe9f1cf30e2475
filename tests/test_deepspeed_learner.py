"""The DeepSpeed learner (world size 1, gloo) trains the model its engine wraps as the torch learner
trains it, for the model options read from the model's config: a soft cap on the logits (Gemma 2, its head
applied in chunks), a mixture of experts' load-balancing loss, and the prompts shared under gradient
checkpointing and in packed micro batches. The engine passes attribute reads through to its model, but its
``config`` is DeepSpeed's own: read there, these options were silently lost (the cap applied to the hidden
states, the router loss off, every sample's prompt recomputed or padded). Both learners run in a process of
their own (:mod:`tests.deepspeed_cases`), which this module starts once."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deepspeed_cases import LR
from tests.helpers import clean_env, random_batch

pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed") / "cases.json"
    # without the process-group variables an in-process sharded learner of this worker left set (its port)
    done = subprocess.run([sys.executable, "-m", "tests.deepspeed_cases", str(out)], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def _case(cases: dict, name: str) -> dict:
    case = cases[name]
    assert "error" not in case, case.get("error")
    return case


def _same_update(case: dict) -> None:
    want, got = case["want"], case["got"]
    assert got["loss/policy"] == pytest.approx(want["loss/policy"], abs=1e-6)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert case["worst"] < 0.05 * LR


@pytest.mark.parametrize("stage", [2, 3])
def test_soft_capped_logits_chunked_through_the_engine_train_as_the_torch_learner(cases, stage):
    """Two tokens of logits a chunk: the update's forward (through the engine) gives the old log-probs
    back (ratio 1) and the torch learner's gradient and weights; the engine once capped the hidden states."""
    case = _case(cases, f"soft_cap_zero{stage}")
    assert case["got"]["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    _same_update(case)


def test_the_load_balancing_loss_reaches_the_deepspeed_update(cases):
    """--learner.router_aux_loss_coef on a reduced Qwen3-30B-A3B: the DeepSpeed update adds the router
    loss the torch learner adds (logged, same value, same gradient); it was silently left out."""
    case = _case(cases, "router_loss")
    want, got = case["want"], case["got"]
    assert want["loss/router_aux"] > 0
    assert got.get("loss/router_aux") == pytest.approx(want["loss/router_aux"], rel=1e-5)
    _same_update(case)


def test_weight_decay_leaves_norms_and_biases_alone_through_the_engine(cases):
    """ZeRO-3 with --learner.weight_decay 0.5: the engine's optimizer decays what the torch learner decays
    (not the Gemma 2's many norms: decaying them moves each gain by lr x 0.5, ten times the tolerance)."""
    _same_update(_case(cases, "weight_decay"))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_whose_optimizer_decayed_everything_is_one_line_and_resumes_with_weight_decay_all(
        cases, stage):
    """A ZeRO checkpoint of an optimizer with one param group (every parameter decayed, as before biases and
    norms were left alone): DeepSpeed's own failure (a ValueError or a RuntimeError about the layout, each
    stage its own) becomes the line naming the flag, and the flag resumes it."""
    case = _case(cases, "old_checkpoint")[f"zero{stage}"]
    assert case["now"] == {"error": "UsageError", "line": (
        f"{case['folder']}'s optimizer decays every parameter (written before biases and norms were left "
        "undecayed); resume it with --learner.weight_decay_all true")}
    assert case["all"] == {"updates": 1}


def test_zero3_under_gradient_checkpointing_runs_each_prompt_once(cases):
    """With checkpointing, the prompts' shared forward needs this package's prompt cache (transformers
    drops a checkpointed layer's cache): through the engine it is made from the model's config, the
    update's embedding sees each prompt once (3 rows, not the 12 samples whole), and the update equals
    the torch learner's."""
    case = _case(cases, "checkpointing")
    assert case["caches"] and all(case["caches"])
    rows = [shape[0] for shape in case["shapes"]]
    assert rows.count(3) == 2 and rows.count(12) == 2  # each learner: 3 prompts, then 12 completions
    _same_update(case)


def test_packed_micro_batches_hold_each_prompt_once_through_the_engine(cases):
    """Token-budget micro batches: through the engine the model attends per sample, so its packed rows
    hold each group's prompt once, as the torch learner's do (the same rows, the same update); the
    engine's config once hid the model's attention and every sample went in whole."""
    case = _case(cases, "packed")
    shapes = case["shapes"]  # the DeepSpeed update's embedding calls, then the torch one's
    ds, local = shapes[: len(shapes) // 2], shapes[len(shapes) // 2:]
    whole = int(random_batch(group=4, prompts=3, seed=5)["attention_mask"].sum())  # every prompt and completion
    assert ds == local and all(rows == 1 for rows, _ in ds)
    assert sum(width for _, width in ds) < whole - 2 * 3 * 3  # each prompt (3+ tokens) once, not 4 times
    _same_update(case)


def test_adapter_sync_under_zero3_gathers_the_adapter_alone(cases):
    """--sync.method adapter moves a few MB: under ZeRO-3 only the trained tensors (the LoRA pairs) are
    gathered for it, not the frozen base (the whole model, gathered at every sync before), and what it sends
    is the adapter under PEFT's names."""
    case = _case(cases, "adapter_gather")
    assert case["gathered"] == case["gathered_trained"] == case["trained"] > 0
    assert case["total"] > case["trained"]
    assert case["r"] == 4 and case["names"] and all(".lora_A." in n or ".lora_B." in n for n in case["names"])


def test_a_merged_lora_sync_under_zero3_holds_one_module_gathered_at_a_time(cases):
    """The merged export (what vLLM loads) folds each LoRA module as soon as its gathered tensors are in:
    a rank holds one layer's weight, bias and LoRA pair, never the whole gathered model (it did before)."""
    case = _case(cases, "adapter_gather")
    assert case["merged_held"] <= 4 < case["merged_sent"]
