"""vLLM (the CPU build here) as the generation engine, for real: samples, log-probs,
weight sync parity by every method, Ray engines, and a training run."""
from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.integration

from rlhf_plugins import SamplingParams  # noqa: E402
from rlhf_plugins.api import prepare  # noqa: E402
from rlhf_plugins.models.forward import policy_forward  # noqa: E402
from rlhf_plugins.sync import verify_parity  # noqa: E402
from tests.helpers import (  # noqa: E402
    Actor,
    batch_of,
    draws_of_a_seeded_engine,
    eval_rows_of,
    metrics_of,
    prompts,
    run_subprocess,
    short_run,
    the_run,
)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="class")
def engine(tiny_model):
    from rlhf_plugins.engines.vllm_engine import VLLMEngine
    from rlhf_plugins.testing import backend_context

    config, pm, _ = prepare({"generation": {"backend": "vllm"}}, autoload=False)
    eng = VLLMEngine(backend_context(config, "generation", tiny_model, pm))
    yield eng
    eng.shutdown()


def test_a_model_the_engine_rejects_is_one_line_with_the_engines_reason(tmp_path):
    """In a subprocess: a failed in-process engine leaves vLLM's process-wide state behind."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_plugins.testing import tiny_model_path
    from tests.helpers import run_subprocess

    src = Path(tiny_model_path())
    model = tmp_path / "model"
    cfg = LlamaConfig.from_pretrained(src)
    cfg.hidden_size, cfg.head_dim = 96, 24  # head_dim 24: vLLM's CPU attention starts, then rejects it
    LlamaForCausalLM(cfg).save_pretrained(model)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / f).write_bytes((src / f).read_bytes())
    proc = run_subprocess("train", "--model.path", str(model), "--generation.backend", "vllm", *short_run(), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rlhf: error: vLLM could not start an engine for '{model}'") and "head_dim=24" in last
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


class TestEngine:
    """One engine for these tests, shut down before the next starts (one vLLM engine per process)."""

    def test_samples_and_logprobs_match_the_learner(self, engine, tiny_model):
        from transformers import AutoModelForCausalLM

        ids = prompts(tiny_model)
        samples = engine.generate(ids, SamplingParams(n=3, max_new_tokens=6, temperature=1.0, seed=7))
        assert samples.prompt_index == [i for i in range(4) for _ in range(3)]
        assert all(len(c) == len(lp) >= 1 for c, lp in zip(samples.completion_ids, samples.logprobs))
        assert set(samples.finish_reasons) <= {"stop", "length"}
        batch = batch_of(ids, samples, 3)
        learner = policy_forward(AutoModelForCausalLM.from_pretrained(tiny_model), batch)["logprobs"]
        mask = batch["action_mask"].bool()
        assert (learner - batch["rollout_logprobs"]).abs()[mask].max() < 1e-4


    def test_the_repetition_penalty_and_min_p_sample_as_by_hand(self, engine, tiny_model):
        """vLLM's processed log-probs are of the penalized, tempered distribution (renormalized after
        min-p, so the log-probs are compared without it); min-p draws nothing below its share."""
        from transformers import AutoModelForCausalLM

        from tests.helpers import sampling_logprobs

        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        ids = prompts(tiny_model)
        penalized = SamplingParams(n=3, max_new_tokens=8, temperature=0.8, repetition_penalty=1.5, seed=5)
        for params in (penalized, dataclasses.replace(penalized, min_p=0.02)):
            samples = engine.generate(ids, params)
            for i, completion, logprobs in zip(samples.prompt_index, samples.completion_ids, samples.logprobs):
                want, probs = sampling_logprobs(model, ids[i], completion, 0.8, 1.5)
                drawn = probs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
                assert (drawn >= params.min_p * probs.max(-1).values).all()
                if not params.min_p:
                    assert torch.allclose(torch.tensor(logprobs, dtype=torch.float64), want, atol=1e-4)

    def test_stop_strings_end_completions_by_the_transformers_engines_rule(self, engine, tiny_model):
        """vLLM's stop (what generation.stop sets): the token completing a stop string is the last one kept,
        the rule tests/test_sampling_knobs.py holds the transformers engine to."""
        from transformers import AutoTokenizer

        from tests.helpers import stopped_by_strings

        stop = ("1", "s")
        samples = engine.generate(prompts(tiny_model), SamplingParams(n=4, max_new_tokens=12, temperature=2.0, seed=3,
                                                                      stop=stop))
        assert stopped_by_strings(AutoTokenizer.from_pretrained(tiny_model), samples, stop) >= 4

    def test_inprocess_sync_changes_the_engine_and_keeps_parity(self, engine, tiny_model):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_model)
        ids = prompts(tiny_model)
        batch = batch_of(ids, engine.generate(ids, SamplingParams(n=2, max_new_tokens=4, seed=1)), 2)
        before = engine.logprobs(batch)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        info = engine.load_weights(model.state_dict().items())
        assert info["tensors"] == len(model.state_dict())
        after = engine.logprobs(batch)
        mask = batch["action_mask"].bool()
        assert (after - before).abs()[mask].max() > 1e-3  # the weights really changed
        assert verify_parity(Actor(model), engine, batch) < 1e-4


    def test_a_sync_loaded_part_by_part_keeps_parity_with_layers_split_between_parts(self, engine, tiny_model):
        """What the broadcast sync does with vLLM: each bucket goes in as it arrives (nothing staged),
        parts of three tensors in reverse order, so fused tensors (q/k/v, gate/up) straddle parts and
        a layer is complete only some parts later; the commit closes the reload."""
        from transformers import AutoModelForCausalLM

        from rlhf_plugins.engines.vllm_worker import READING
        from rlhf_plugins.sync.broadcast import commit_worker, pending, receive

        model = AutoModelForCausalLM.from_pretrained(tiny_model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        named = list(reversed(model.state_dict().items()))
        ids = prompts(tiny_model)
        batch = batch_of(ids, engine.generate(ids, SamplingParams(n=2, max_new_tokens=4, seed=1)), 2)
        assert verify_parity(Actor(model), engine, batch, tol=1e3) > 1e-3  # not yet these weights

        def feed(worker, part):
            receive(worker, part)
            return worker.state.get(READING), len(pending(worker))

        for start in range(0, len(named), 3):
            assert engine.model_workers(feed, named[start : start + 3]) == [(True, 0)]
        engine.model_workers(commit_worker)
        assert engine.model_workers(lambda worker: worker.state.get(READING)) == [None]
        assert verify_parity(Actor(model), engine, batch) < 1e-4

    def test_seeded_prompts_beyond_one_scheduler_step_are_all_sampled(self, engine, tiny_model):
        """More prompt tokens than vLLM schedules in one step (4096): with chunked prefill, vLLM's CPU
        build fails on seeded requests ("CPU Generator does not use offset"); the engine prefills whole."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tiny_model)
        long = tok.apply_chat_template([{"role": "user", "content": " + ".join(["12"] * 60) + " ="}],
                                       add_generation_prompt=True)["input_ids"]
        ids = [long] * 40
        assert len(long) * len(ids) > 4096 and len(long) + 4 <= 256
        samples = engine.generate(ids, SamplingParams(n=2, max_new_tokens=4, seed=5))
        assert samples.prompt_index == [i for i in range(40) for _ in range(2)]
        assert all(len(c) >= 1 for c in samples.completion_ids)
        again = engine.generate(ids, SamplingParams(n=2, max_new_tokens=4, seed=5))
        assert again.completion_ids == samples.completion_ids  # seeded: the same samples


    def test_every_prompt_and_every_adjacent_seed_draws_a_stream_of_its_own(self, engine):
        """vLLM seeds a request's k-th sample with its seed + k: with the call's seed on every request, each
        prompt's k-th sample came from one stream (a near-uniform model's prompts got the same tokens, equal
        contexts the same continuation), and seed s + 1 drew seed s's samples shifted by one."""
        draws = draws_of_a_seeded_engine(engine)
        assert len(set(draws["repeated"])) == 6
        assert draws["seed6"][:2] != draws["seed5"][1:] and not set(draws["seed5"]) & set(draws["seed6"])
        assert draws["again"] == draws["repeated"]  # seeded: the same samples


def test_engine_dtype_auto_runs_a_float32_model_in_vllms_dtype_and_takes_float32_weights(tiny_model):
    """``--vllm.dtype auto``: vLLM picks its dtype (bfloat16 on CPU for a float32 checkpoint), as
    vLLM's own users and TRL's vLLM path get, while the learner stays in float32."""
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.engines.vllm_engine import VLLMEngine
    from rlhf_plugins.testing import backend_context

    config, pm, _ = prepare({"generation": {"backend": "vllm"}, "vllm": {"dtype": "auto"}}, autoload=False)
    assert config.model.dtype == "float32"
    engine = VLLMEngine(backend_context(config, "generation", tiny_model, pm))
    try:
        assert engine.llm.llm_engine.model_config.dtype == torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(tiny_model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        engine.load_weights(model.state_dict().items())
        ids = prompts(tiny_model)
        batch = batch_of(ids, engine.generate(ids, SamplingParams(n=2, max_new_tokens=4, seed=1)), 2)
        gap = verify_parity(Actor(model), engine, batch, tol=1.0)
        # what bfloat16 weights and arithmetic cost on this CPU (its kernels round differently with and
        # without bfloat16 instructions), measured with transformers on the same batch
        rounding = verify_parity(Actor(model), Actor(copy.deepcopy(model).to(torch.bfloat16)), batch, tol=1.0)
        assert 1e-4 < gap < 3 * rounding + 0.01, (gap, rounding)  # close, not exact; garbage is > 1
    finally:
        engine.shutdown()


def test_local_vllm_run_learns_with_matching_rollout_logprobs(rlhf):
    code, _, err = rlhf("train", "--generation.backend", "vllm", "--algo.policy_loss.mismatch", "tis",
                        "--sync.verify", "true", "--train.steps", "40", "--train.progress", "false")
    assert code == 0, err
    rows = metrics_of(the_run())
    head = sum(r["reward/mean"] for r in rows[:8]) / 8
    tail = sum(r["reward/mean"] for r in rows[-8:]) / 8
    assert tail - head > 0.1, (head, tail)
    # the engine samples from the learner's exact policy: importance ratios stay at 1
    assert all(r["mismatch/abs_log_ratio"] < 1e-4 for r in rows)
    # held-out evaluation ran through the vLLM engine, before and after, and the policy improved on it
    evals = eval_rows_of(the_run())
    assert [r["step"] for r in evals] == [0, 40] and evals[1]["eval/pass@1"] > evals[0]["eval/pass@1"]


def test_sleep_on_cpu_is_said_once_and_frees_nothing(rlhf):
    code, _, err = rlhf("train", "--generation.backend", "vllm", "--vllm.sleep", "true", *short_run("--train.steps", "2"))
    assert code == 0, err
    assert err.count("vLLM sleep mode is not available on CPU") == 1
    assert not any("freed" in k for r in metrics_of(the_run()) for k in r)


@pytest.mark.parametrize(
    "args",
    [
        # prompts spread over two engines, both synced one tensor per bucket (whole buckets: the seeds'
        # production layout in test_real_shape.py)
        ["--vllm.num_engines", "2", "--eval.enabled", "true", "--sync.bucket_mb", "0"],
        ["--ray.colocate", "all", "--sync.method", "ipc", "--learner.backend", "deepspeed",
         "--deepspeed.zero_stage", "3", "--ray.actor_workers", "2"],
    ],
    ids=["two-engines-per-tensor", "ipc-zero3"],
)
def test_ray_engines_and_every_sync_method_keep_parity(rlhf, args):
    code, _, err = rlhf("train", "--placement.strategy", "ray", "--ray.local_num_gpus", "4",
                        "--generation.backend", "vllm", "--sync.verify", "true", "--algo.policy_loss.mismatch", "tis",
                        *short_run(), *args)
    assert code == 0, err
    rows = metrics_of(the_run())
    assert all(r["mismatch/abs_log_ratio"] < 1e-4 for r in rows)
    assert all(r["completion/stopped"] > 0.5 for r in rows)  # a broken sync makes garbage that never stops
    if "--eval.enabled" in args:  # held-out evaluation through Ray engine actors
        evals = eval_rows_of(the_run())
        assert [r["step"] for r in evals] == [0, 3] and all(0 <= r["eval/pass@1"] <= 1 for r in evals)


@pytest.mark.parametrize("raw, empty", [
    ({"placement": {"strategy": "ray"}}, True),  # broadcast: every weight comes from the learner anyway
    ({"placement": {"strategy": "ray"}, "vllm": {"load_format": "checkpoint"}}, False),
    ({"placement": {"strategy": "ray"}, "lora": {"rank": 4}, "sync": {"method": "adapter"}}, False),  # base weights
    ({}, False),  # in-process sync into the engine: the checkpoint is read once, here
    ({"vllm": {"load_format": "dummy"}}, True),
])
def test_the_engine_starts_with_placeholder_weights_only_where_the_learner_sends_every_weight(tiny_model, raw, empty):
    """``--vllm.load_format auto``: placeholder weights (no memory map of the checkpoint while the
    engine loads) when the sync moves every weight from the learner's process; the loop then syncs
    before the first generation (the Ray parity tests above check step 0)."""
    from rlhf_plugins.engines.vllm_arguments import engine_arguments

    config, _, plan = prepare({"generation": {"backend": "vllm"}, **raw}, autoload=False)
    assert plan.engine.starts_empty(config) is empty
    assert (engine_arguments(config, tiny_model, cpu=True, sleep=False).get("load_format") == "dummy") is empty


def test_third_party_noise_stays_out_of_the_terminal_unless_verbose(tmp_path):
    """vLLM's start-up (Triton notice, deprecation warnings, torch's C++ warnings, load bars) is
    silent on a normal run (a fresh interpreter: every import's notice counts); -v shows it (a forked run
    is enough: vLLM, imported by the run, still logs its start)."""
    quiet = run_subprocess("train", "--generation.backend", "vllm", *short_run("--train.steps", "1"), cwd=tmp_path,
                           env={"RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"}, fresh=True)
    assert quiet.returncode == 0, quiet.stderr
    assert [line for line in quiet.stderr.splitlines() if line.strip() and not line.startswith("rlhf: ")] == []
    loud = run_subprocess("train", "--generation.backend", "vllm", *short_run("--train.steps", "1"), "-v",
                          cwd=tmp_path, env={"RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert loud.returncode == 0, loud.stderr
    # which notices the stack prints depends on the machine (Triton's notice, vLLM's log lines, deprecation
    # warnings); -v lets through whichever there are
    noise = [line for line in loud.stderr.splitlines() if line.strip() and not line.startswith("rlhf: ")]
    assert any(word in line for line in noise for word in ("Triton", "Warning", "INFO", "WARNING")), loud.stderr


@pytest.mark.parametrize("fp32_lm_head", [True, False])
def test_vllm_computes_float32_logits_under_a_float32_head_and_takes_its_sync(tiny_model, fp32_lm_head):
    """``--model.fp32_lm_head`` reaches vLLM as its ``head_dtype`` (``hf_overrides``): the logits vLLM's
    logits processor hands its sampler are float32, computed from the bfloat16 model's hidden states
    (bfloat16 without the option); the learner's float32 head syncs into the engine beside its 16-bit
    weights, whose log-probs of its samples then follow the learner's (a gap of bfloat16 arithmetic,
    where unsynced weights are off by more than 1)."""
    from rlhf_plugins.engines.vllm_engine import VLLMEngine
    from rlhf_plugins.testing import backend_context

    config, pm, _ = prepare({"generation": {"backend": "vllm"},
                             "model": {"dtype": "bfloat16", "fp32_lm_head": fp32_lm_head}}, autoload=False)
    engine = VLLMEngine(backend_context(config, "generation", tiny_model, pm))
    try:
        seen: list[torch.dtype] = []
        engine.model_workers(lambda worker: worker.worker.model_runner.get_model().logits_processor
                             .register_forward_hook(lambda module, args, out: seen.append(out.dtype)))
        learner = pm.load_model("actor", tiny_model, config)
        assert learner.get_output_embeddings().weight.dtype == (torch.float32 if fp32_lm_head else torch.bfloat16)
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for p in learner.parameters():
                p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
        engine.load_weights(learner.state_dict().items())
        ids = prompts(tiny_model)
        batch = batch_of(ids, engine.generate(ids, SamplingParams(n=2, max_new_tokens=4, seed=1)), 2)
        assert seen and set(seen) == {torch.float32 if fp32_lm_head else torch.bfloat16}, set(seen)
        assert verify_parity(Actor(learner), engine, batch, tol=10.0) < 0.5
    finally:
        engine.shutdown()


def test_a_vllm_without_head_dtype_is_told_of_and_keeps_its_head(tiny_model, monkeypatch, caplog):
    """An older vLLM whose logits processor has no ``head_dtype`` would take the override and compute in
    the model's dtype all the same: the run says so once and passes no override."""
    import vllm.model_executor.layers.logits_processor as lp

    from rlhf_plugins.engines.vllm_arguments import engine_arguments

    class OldLogitsProcessor(torch.nn.Module):
        def forward(self, lm_head, hidden_states):
            return lm_head(hidden_states)

    config, _, _ = prepare({"generation": {"backend": "vllm"}, "model": {"dtype": "bfloat16", "fp32_lm_head": True}},
                           autoload=False)
    assert engine_arguments(config, tiny_model, True, False)["hf_overrides"] == {"head_dtype": "float32"}
    monkeypatch.setattr(lp, "LogitsProcessor", OldLogitsProcessor)
    with caplog.at_level("WARNING", logger="rlhf_plugins"):
        assert "hf_overrides" not in engine_arguments(config, tiny_model, True, False)
    assert [r.message for r in caplog.records if "no head_dtype" in r.message] == [
        "this vLLM computes its logits in --model.dtype (no head_dtype); the learner's head is float32 "
        "(--model.fp32_lm_head), the engine's is not: install a newer vllm"]


def test_structured_outputs_make_every_completion_match_the_regex(tiny_model):
    """``--vllm.structured_outputs_regex`` (TRL's ``vllm_structured_outputs_regex``, carried over from a TRL
    config): every completion vLLM samples matches it whole before its end of sequence, where the same
    engine samples freely without it."""
    import re

    from rlhf_plugins.engines.vllm_engine import VLLMEngine
    from rlhf_plugins.integrations.trl_config import from_grpo_fields
    from rlhf_plugins.testing import backend_context

    raw, _ = from_grpo_fields({"use_vllm": True, "vllm_structured_outputs_regex": "[0-9]{3}"})
    assert raw["vllm"]["structured_outputs_regex"] == "[0-9]{3}"
    ids = prompts(tiny_model)
    texts = {}
    for regex in ("[0-9]{3}", None):
        config, pm, _ = prepare({"generation": {"backend": "vllm"}, "vllm": {"structured_outputs_regex": regex}},
                                autoload=False)
        engine = VLLMEngine(backend_context(config, "generation", tiny_model, pm))
        try:
            samples = engine.generate(ids, SamplingParams(n=2, max_new_tokens=8, seed=3))
            tokenizer = engine.llm.get_tokenizer()
            texts[regex] = [tokenizer.decode(c, skip_special_tokens=True) for c in samples.completion_ids]
        finally:
            engine.shutdown()
    assert len(texts["[0-9]{3}"]) == 2 * len(ids)
    assert all(re.fullmatch("[0-9]{3}", t) for t in texts["[0-9]{3}"]), texts["[0-9]{3}"]
    assert not all(re.fullmatch("[0-9]{3}", t) for t in texts[None]), texts[None]


def test_the_engines_lora_rank_bound_covers_the_runs_adapter_in_a_rank_vllm_takes():
    """vLLM starts LoRA engines for a fixed set of ranks: ``--vllm.max_lora_rank`` is raised to the run's own
    ``--lora.rank`` and rounded up into that set (before: a run with --lora.rank 100 failed at its first
    sync with "set --vllm.max_lora_rank 100", a value vLLM refuses to start with)."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    from rlhf_plugins.engines.vllm_lora import LORA_RANKS, lora_rank_bound

    assert LORA_RANKS == typing.get_args(MaxLoRARanks)
    for flags, bound in (({}, 64), ({"lora": {"rank": 100}}, 128), ({"lora": {"rank": 8}}, 64),
                         ({"vllm": {"max_lora_rank": 48}}, 64), ({"lora": {"rank": 300}}, 320)):
        config, _, _ = prepare({"generation": {"backend": "vllm"}, **flags}, autoload=False)
        assert lora_rank_bound(config) == bound, flags


def test_a_fused_modules_lora_adapter_is_split_into_the_parts_vllm_takes():
    """GLM-4's MLP is one ``gate_up_proj`` in transformers and two adapter targets in vLLM: each part keeps
    lora_A and takes its rows of lora_B, so each part's update B_part A is the fused update's rows; other
    modules pass as they are; a split of unknown widths is refused in one line."""
    from rlhf_plugins.engines.vllm_lora import split_fused
    from rlhf_plugins.errors import UsageError

    g = torch.Generator().manual_seed(0)
    layer = "base_model.model.model.layers.0"
    weights = {f"{layer}.mlp.gate_up_proj.lora_A.weight": torch.randn(4, 16, generator=g),
               f"{layer}.mlp.gate_up_proj.lora_B.weight": torch.randn(2 * 24, 4, generator=g),
               f"{layer}.self_attn.q_proj.lora_B.weight": torch.randn(16, 4, generator=g)}
    config = {"r": 4, "target_modules": ["gate_up_proj", "q_proj"]}
    out, cfg = split_fused(weights, config, {"gate_up_proj": ("gate_proj", "up_proj"), "qkv_proj": ("q_proj",)})
    fused = weights[f"{layer}.mlp.gate_up_proj.lora_B.weight"] @ weights[f"{layer}.mlp.gate_up_proj.lora_A.weight"]
    for rows, part in ((slice(0, 24), "gate_proj"), (slice(24, 48), "up_proj")):
        got = out[f"{layer}.mlp.{part}.lora_B.weight"] @ out[f"{layer}.mlp.{part}.lora_A.weight"]
        assert torch.equal(got, fused[rows]), part
    assert out[f"{layer}.self_attn.q_proj.lora_B.weight"] is weights[f"{layer}.self_attn.q_proj.lora_B.weight"]
    assert len(out) == 5 and cfg["target_modules"] == ["gate_proj", "q_proj", "up_proj"] and config["r"] == cfg["r"]
    with pytest.raises(UsageError, match="drop qkv_proj from --lora.target_modules"):
        split_fused({f"{layer}.self_attn.qkv_proj.lora_A.weight": torch.zeros(4, 16)}, config,
                    {"qkv_proj": ("q_proj", "k_proj", "v_proj")})


def test_the_sync_probe_reads_an_adapters_log_probs_of_sequences_of_any_length(tiny_model):
    """``--sync.verify`` under adapter sync: the engine's log-probs of the probe (prompt log-probs of six
    sequences of 6 to 18 tokens) under the synced adapter are the learner's. vLLM maps the rows of prompt
    log-probs to adapters one per request of the step: six requests against another number of rows each
    failed in its CPU kernels (and passed only where a sequence's rows happened to equal the requests, as
    eight sequences of 9 tokens do)."""
    from rlhf_plugins.engines.vllm_engine import VLLMEngine
    from rlhf_plugins.learners.torch_learner import TorchLearner
    from rlhf_plugins.testing import backend_context

    config, pm, _ = prepare({"generation": {"backend": "vllm"}, "lora": {"rank": 8}, "sync": {"method": "adapter"}},
                            autoload=False)
    learner, g = TorchLearner(backend_context(config, "actor", tiny_model, pm)), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    engine = VLLMEngine(backend_context(config, "generation", tiny_model, pm, adapter_sync=True))
    try:
        engine.load_adapter(*learner.adapter_state())
        ids = [list(range(40, 40 + k)) for k in (5, 9, 12)]
        batch = batch_of(ids, engine.generate(ids, SamplingParams(n=2, max_new_tokens=6, seed=1)), 2)
        rows = [length - 1 for length in batch["attention_mask"].sum(1).tolist()]  # each request's log-prob rows
        assert len(set(rows)) > 1 and any(r != len(rows) for r in rows)
        assert verify_parity(Actor(learner.model), engine, batch) < 1e-4
        with learner.model.disable_adapter():  # the adapter is what the engine's log-probs follow
            assert verify_parity(Actor(learner.model), engine, batch, tol=1e3) > 1e-3
    finally:
        engine.shutdown()


def test_a_lora_adapter_on_glm4s_fused_mlp_syncs_into_vllm():
    """A reduced GLM-4 with LoRA on every linear layer (its fused ``gate_up_proj`` among them), adapters
    trained away from zero: vLLM loads the adapter the learner hands over (it refused the fused name) and
    samples with the learner's log-probs; vLLM's Phi-3 takes its fused modules as they are."""
    from rlhf_plugins.engines.vllm_engine import VLLMEngine
    from rlhf_plugins.engines.vllm_lora import split_parts
    from rlhf_plugins.learners.torch_learner import TorchLearner
    from rlhf_plugins.testing import backend_context
    from tests.helpers import family_model_path

    path = family_model_path("glm4")
    config, pm, _ = prepare({"generation": {"backend": "vllm"}, "model": {"path": path}, "lora": {"rank": 8},
                             "sync": {"method": "adapter"}}, autoload=False)
    learner = TorchLearner(backend_context(config, "actor", path, pm))
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    weights, lora_config = learner.adapter_state()
    assert any(".mlp.gate_up_proj.lora_B" in name for name in weights)
    engine = VLLMEngine(backend_context(config, "generation", path, pm, adapter_sync=True))
    try:
        vllm_config = engine.llm.llm_engine.vllm_config.model_config
        assert split_parts(vllm_config)["gate_up_proj"] == ("gate_proj", "up_proj")
        assert engine.load_adapter(weights, lora_config)["tensors"] > len(weights)  # split into its parts
        ids = prompts(path)
        batch = batch_of(ids, engine.generate(ids, SamplingParams(n=2, max_new_tokens=6, seed=1)), 2)
        assert verify_parity(Actor(learner.model), engine, batch) < 1e-4
    finally:
        engine.shutdown()

    class Phi3:  # the engine's model config, naming vLLM's Phi-3 instead
        architectures = ["Phi3ForCausalLM"]

        def __getattr__(self, name):
            return getattr(vllm_config, name)

    assert "gate_up_proj" not in split_parts(Phi3())
