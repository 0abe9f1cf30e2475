"""Real model sizes: exact shapes, the analytic memory model, the plan before launch, weights kept
once, DeepSpeed sized from the model, defaults by size, and out of memory as one actionable line."""
from __future__ import annotations

import json
import resource
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from rlhf_plugins.models.memory import GIB, ModelShape
from rlhf_plugins.models.shapes import SHAPES, shape_config
from rlhf_plugins.testing import reduced_model_path
from tests.helpers import clean_env, random_batch, short_run


@pytest.fixture(scope="module")
def reduced() -> str:
    return reduced_model_path()


@pytest.mark.parametrize("name, parameters", [("qwen2.5-0.5b", 494_032_768), ("qwen3-0.6b", 596_049_920),
                                              ("llama-3.2-1b", 1_235_814_400)])
def test_shapes_have_the_public_models_parameter_counts(name, parameters):
    """The counts the model cards give (tied embeddings counted once)."""
    assert name in SHAPES
    shape = ModelShape.from_config(shape_config(name))
    assert shape.parameters == parameters and shape.tied
    assert shape.largest_tensor == shape.vocab * shape.hidden


@pytest.mark.parametrize("name, parameters, experts", [("olmo-2-1b", 1_484_916_736, 0),
                                                       ("gpt-oss-20b", 20_914_757_184, 32),
                                                       ("mixtral-8x7b", 46_702_792_704, 8),
                                                       ("qwen1.5-moe-a2.7b", 14_315_784_192, 60)])
def test_untied_shapes_have_the_public_parameter_counts(name, parameters, experts):
    """OLMo-2-0425-1B, gpt-oss-20b (32 experts, 4 per token), Mixtral-8x7B (8 experts, 2 per token)
    and Qwen1.5-MoE-A2.7B (60 experts, 4 per token, a shared expert): the counts of their published
    weights."""
    shape = ModelShape.from_config(shape_config(name))
    assert shape.parameters == parameters and not shape.tied and shape.experts == experts


def test_the_mixture_of_experts_shape_has_the_public_parameter_count():
    """Qwen3-30B-A3B: 30,532,122,624 parameters (untied), 128 experts of width 768, 8 per token; its
    largest tensor is a layer's fused expert gate-up projection, not the embedding."""
    shape = ModelShape.from_config(shape_config("qwen3-30b-a3b"))
    assert shape.parameters == 30_532_122_624 and not shape.tied
    assert (shape.experts, shape.experts_per_token, shape.expert_intermediate) == (128, 8, 768)
    assert shape.largest_tensor == 128 * 2 * 768 * 2048


def _record_storage(params: set[int], saved: dict[int, int], t: torch.Tensor) -> torch.Tensor:
    """A saved-tensors hook: the bytes of each storage autograd keeps that is not a parameter's."""
    storage = t.untyped_storage()
    if storage.data_ptr() not in params:
        saved[storage.data_ptr()] = storage.nbytes()
    return t


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_estimate_matches_what_a_real_forward_saves_for_backward(dtype, compiled):
    """The per-token, per-layer activation bytes of the memory model against the tensors autograd
    actually saves (parameters aside) in a Qwen2 forward: within 15% at two widths; also with the
    norms and MLPs compiled (--learner.compile), which keep about a quarter less. A Qwen3-MoE forward
    (8 of 128 experts per token, its routed block eager when compiled) keeps two thirds more than a
    dense MLP of its config's width: the estimate follows it within 15% too."""
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.models.compiled import compile_blocks, cpu_compiler
    from rlhf_plugins.models.forward import policy_forward

    if compiled and cpu_compiler() is None:
        pytest.skip("torch.compile on a CPU needs a C++ compiler")
    for name, hidden, layers in (("qwen2.5-0.5b", 896, 2), ("qwen2.5-0.5b", 256, 3), ("qwen3-30b-a3b", 256, 2)):
        config = shape_config(name, layers=layers, hidden=hidden)
        # the vocabulary sizes the embedding and head, not what a layer keeps: with 512 tokens the bytes
        # measured are the real vocabulary's to the byte, in a tenth of the time (initialising 151,936 rows)
        config.vocab_size = 512
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        if compiled:
            compile_blocks(model, torch.device("cpu"))
        batch = dict(random_batch(group=4, prompts=4, seed=0), group_size=1)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}
        with torch.autograd.graph.saved_tensors_hooks(partial(_record_storage, params, saved), lambda t: t):
            policy_forward(model, batch, logits_memory_mb=0.001)  # logits aside: a chunk of one token
        measured = sum(saved.values()) / batch["sequences"].numel() / layers
        shape = ModelShape.from_config(config)
        estimate = shape.activation_elements_per_token(compiled) * dtype.itemsize
        assert estimate == pytest.approx(measured, rel=0.15), (name, hidden, measured, estimate)
        if compiled and not shape.experts:  # what compiling saves is real: well under the eager estimate
            assert measured < 0.85 * shape.activation_elements_per_token() * dtype.itemsize


def test_a_layout_that_cannot_fit_is_refused_before_anything_starts(rlhf, reduced, monkeypatch):
    """Its minimum against a node of 0.1 GB: exit 2, one line naming the largest role and the flags,
    nothing on disk."""
    import rlhf_plugins.models.memory as memory

    monkeypatch.setattr(memory, "this_machine", lambda config=None: int(0.1 * GIB))
    code, out, err = rlhf("train", "--model.path", reduced, *short_run())
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert "this layout needs at least" in line and "the node has 102 MB" in line and "the largest is actor" in line
    assert "--learner.backend deepspeed --deepspeed.zero_stage 3" in line or "--lora.rank" in line
    assert not Path("runs").exists()


@pytest.mark.parametrize("learner, told", [
    ({}, "shard them: --learner.backend deepspeed"),
    ({"learner": {"backend": "deepspeed"}, "deepspeed": {"zero_stage": 1}}, "spread them over more ranks"),
    ({"learner": {"backend": "deepspeed"}, "deepspeed": {"zero_stage": 3}}, "spread them over more ranks"),
    ({"learner": {"backend": "fsdp"}}, "spread them over more ranks"),
], ids=["torch", "zero-1", "zero-3", "fsdp"])
def test_a_refusal_does_not_tell_a_sharding_learner_to_shard(reduced, learner, told):
    """What the refusal names for each kind of memory leaves out what the run already does: ZeRO and
    FSDP2 are told to spread their shards over more ranks, the torch learner to shard."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.errors import ConfigError
    from rlhf_plugins.training.memory_plan import memory_plan

    short = {"data": {"max_prompt_tokens": 8}, "generation": {"max_new_tokens": 8, "n_samples_per_prompt": 2},
             "train": {"prompts_per_step": 1}}  # so that the optimizer states lead the refusal
    config, _, plan = prepare({"model": {"path": reduced}, **short, **learner}, autoload=False)
    mp = memory_plan(config, plan)
    assert mp.remedies["optimizer states"].startswith(told)
    stage = 3 if learner.get("learner", {}).get("backend") == "fsdp" else learner.get("deepspeed", {}).get("zero_stage", 0)
    if stage:  # the refusal's line (the torch learner's small run is refused for its imports instead)
        mp.node_bytes = 2**20
        with pytest.raises(ConfigError) as refused:
            mp.check()
        need = mp.roles["actor"].parts["optimizer states"] / 2**20
        assert f"optimizer states ({need:.0f} MB): {told}" in str(refused.value)
    assert ("spread them" in mp.remedies["gradients"]) == (stage >= 2)
    assert ("spread them" in mp.remedies["weights"]) == (stage == 3)
    assert ("--learner.backend deepspeed" in mp.remedies["optimizer states"]) == (stage == 0)


def test_dry_run_prints_each_roles_need_and_the_node(rlhf, reduced):
    code, out, err = rlhf("train", "--model.path", reduced, "--dry-run", *short_run())
    assert code == 0, err
    plan = out[out.index("memory plan:"):]
    assert "of the node's" in plan and "20.1M parameters in float32" in plan
    for role in ("generation", "actor", "reference"):
        assert f"] {role} " in plan
    assert "weights (the actor's, shared)" in plan  # the transformers engine reads the learner's tensors


def test_deepspeed_buckets_are_sized_from_the_model_not_its_defaults(reduced):
    from rlhf_plugins.api import prepare
    from rlhf_plugins.learners.deepspeed_config import deepspeed_config

    config, _, _ = prepare({"model": {"path": reduced}, "learner": {"backend": "deepspeed"},
                            "deepspeed": {"zero_stage": 3}}, autoload=False)
    shape = ModelShape.of_folder(reduced)
    zero = deepspeed_config(config, "actor", 2, shape)["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == max(shape.hidden ** 2, shape.layer_parameters)
    assert zero["reduce_bucket_size"] < 5e8 / 100  # DeepSpeed's default: 2 GB of float32 per bucket
    assert zero["stage3_max_live_parameters"] >= shape.largest_tensor  # the embedding can still be gathered


def _trainer(raw):
    from transformers import AutoTokenizer

    from rlhf_plugins.api import prepare
    from rlhf_plugins.data.prompts import load_prompts
    from rlhf_plugins.models.tiny_model import default_model_path
    from rlhf_plugins.training.loop import Trainer

    path = default_model_path()
    config, pm, plan = prepare(raw, autoload=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return Trainer(config, pm, plan, load_prompts(config.data, tokenizer), tokenizer, path)


def test_the_engine_reads_the_learners_parameters_in_a_synchronous_run_and_copies_them_otherwise():
    sync = _trainer({"train": {"steps": 2, "prompts_per_step": 4}})
    sync.setup()
    try:
        live = dict(sync.actor.live_weights())
        engine = dict(sync.engine.engine.model.named_parameters())
        assert live.keys() == engine.keys()
        assert all(live[n].data_ptr() == engine[n].data_ptr() for n in live)
        before = {n: t.clone() for n, t in live.items()}
        sync.step(0)
        moved = [n for n in live if not torch.equal(before[n], engine[n])]
        assert moved and sync.sync.shared  # the update reached the engine without a copy
    finally:
        sync.shutdown()
    staleness = {"train": {"steps": 2, "prompts_per_step": 4, "max_staleness": 1},
                 "algo": {"policy_loss": {"mismatch": "tis"}}}
    ahead = _trainer(staleness)
    ahead.setup()
    try:
        assert not ahead.sync.shared  # the engine samples with an older policy while the learner trains
        live = dict(ahead.actor.live_weights())
        engine = dict(ahead.engine.engine.model.named_parameters())
        assert not any(live[n].data_ptr() == engine[n].data_ptr() for n in live)
    finally:
        ahead.shutdown()


def test_a_large_model_gets_real_model_defaults_unless_the_run_sets_them(rlhf, reduced, monkeypatch):
    import yaml

    import rlhf_plugins.config.scale as scale

    monkeypatch.setattr(scale, "REAL_MODEL_PARAMETERS", 10_000_000)  # the 20M reduced model counts as real
    code, out, err = rlhf("train", "--model.path", reduced, "--critic.lr", "3e-5", "--dry-run", *short_run())
    assert code == 0, err
    config = yaml.safe_load(out[out.index("model:"):out.index("note:")])
    assert config["learner"]["lr"] == 1e-6 and config["critic"]["lr"] == 3e-5  # what the user set stays
    assert config["learner"]["warmup_ratio"] == 0.03 and config["learner"]["lr_scheduler"] == "cosine"
    assert config["learner"]["gradient_checkpointing"] is True
    assert "note: defaults for a 20M-parameter model" in out and "critic.lr" not in out[out.index("note:"):]
    code, out, _ = rlhf("train", "--dry-run", *short_run())  # the embedded tiny model keeps its tuned rate
    assert code == 0 and yaml.safe_load(out[out.index("model:"):out.index("memory plan")])["learner"]["lr"] == 5e-4


def test_a_first_update_that_moves_kl_too_far_says_so_naming_lr(rlhf, reduced, monkeypatch, tmp_path):
    """AdamW at 0.05 moves every weight by about 0.05 on a first update whose gradient is small but
    not zero (a reward that varies a little): the second step's KL says so, naming the rate."""
    import rlhf_plugins.config.scale as scale

    monkeypatch.setattr(scale, "REAL_MODEL_PARAMETERS", 10_000_000)
    reward = tmp_path / "tiny_signal.py"
    reward.write_text("def tiny_signal(prompts, completions, completion_ids, **kwargs):\n"
                      "    return [1e-3 * sum(ids) % 1.0 for ids in completion_ids]\n")
    code, _, err = rlhf("train", "--model.path", reduced, "--plugin", str(reward), "--learner.lr", "0.05",
                        *short_run("--train.steps", "2", "--generation.max_new_tokens", "4"))
    assert code == 0, err
    assert "after the first update (above 0.05): learner.lr 0.05 is likely too high" in err


def test_out_of_memory_is_one_line_naming_the_role_its_need_and_the_flags(tmp_path, reduced):
    """A run whose full-vocabulary logits (2.5 GB a tensor; the plan's minimum 7.5 GB fits a 10 GB
    machine) cannot be allocated under a 4 GB address-space limit: exit 1, one line naming the role,
    its measured peak and analytic need and what to change, no traceback, and status.json saying so."""
    limit = 4 * GIB

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    args = ["--model.path", reduced, "--learner.logits_memory_mb", "0", "--train.prompts_per_step", "16",
            "--generation.n_samples_per_prompt", "16", "--generation.max_new_tokens", "16",
            "--train.steps", "1", "--eval.enabled", "false", "--train.progress", "false"]
    proc = subprocess.run([sys.executable, "-m", "rlhf_plugins.cli", "train", *args], cwd=tmp_path,
                          env=clean_env({"RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"}), capture_output=True, text=True,
                          timeout=600, preexec_fn=cap)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = lines[0]
    assert line.startswith("rlhf: error: role '") and "ran out of memory" in line
    assert "its process peaked at" in line and "its analytic need is" in line and "reduce it -- " in line
    (run,) = list((tmp_path / "runs").iterdir())
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and "ran out of memory" in status["message"]


@pytest.mark.parametrize("offload", [False, True])
def test_zero3_memory_items_by_hand(offload):
    """ZeRO-3 over 2 ranks, float32, AdamW: each rank holds half of the weights, gradients and the two
    Adam states; float32 weights are their own master unless the optimizer is offloaded, which then
    keeps a float32 master and a gradient partition of its own. In the backward the gathered embedding
    has a full gradient and the collective a buffer for it."""
    from rlhf_plugins.config.schema import Config
    from rlhf_plugins.models.memory import MemoryInputs, deepspeed_learner_memory

    shape = ModelShape(parameters=1000, layer_parameters=300, largest_tensor=400, vocab=50, hidden=8,
                       intermediate=16, layers=2, q_dim=8, kv_dim=4, tied=True)
    m = MemoryInputs(Config(), shape, "actor", ranks=2, trainable=1000, micro_tokens=0, logits_bytes=0,
                     options={"zero_stage": 3, "offload_optimizer": offload})
    items = deepspeed_learner_memory(m)
    assert items["weights"] == 2000 and items["gathered tensor"] == 1600
    assert items["gathered tensor's gradient"] == 3200  # the embedding's full gradient and the reduce-scatter's buffer
    assert items["gradients"] == 2000 and items["optimizer states"] == 4000
    assert items.get("fp32 master weights", 0) == (2000 if offload else 0)
    assert items.get("offloaded gradients", 0) == (2000 if offload else 0)


def test_an_engine_that_loads_a_sync_as_it_arrives_stages_buckets_not_the_model(tiny_model):
    """Broadcast sync into an engine with load_weights_part: the bucket in flight (a tensor larger than
    a bucket travels alone), the earlier bucket a layer began in, and the engine's new copy of the
    layer or tensor under way; an engine without it keeps every bucket of the sync: a whole copy."""
    import dataclasses

    from rlhf_plugins.api import prepare
    from rlhf_plugins.models.memory import streamed_staging
    from rlhf_plugins.training.memory_plan import memory_plan

    shape = ModelShape(parameters=1000, layer_parameters=300, largest_tensor=400, vocab=50, hidden=8,
                       intermediate=16, layers=2, q_dim=8, kv_dim=4, tied=True)
    assert streamed_staging(shape, whole=4000, bucket=800) == 1600 + 800 + 1600
    assert streamed_staging(shape, whole=4000, bucket=1600) == 4000  # never more than the whole copy
    raw = {"model": {"path": tiny_model}, "placement": {"strategy": "ray"}, "ray": {"local_num_gpus": 4},
           "sync": {"method": "broadcast", "bucket_mb": 1 / 16}}
    config, _, plan = prepare(raw, autoload=False)
    assert plan.engine.streams_weights
    real = ModelShape.of_folder(tiny_model)
    parts = memory_plan(config, plan).roles["generation"].parts
    assert parts["sync staging"] == streamed_staging(real, parts["weights"], 2**16) < parts["weights"]
    whole = memory_plan(config, dataclasses.replace(plan, engine=dataclasses.replace(plan.engine, streams_weights=False)))
    assert whole.roles["generation"].parts["sync staging"] == parts["weights"]


def test_the_vllm_engine_items_by_hand():
    """Weights in the engine's dtype, the sampler's two float32 logit rows per sequence, vLLM's imports,
    and on the CPU build the output head packed for its kernels beside its own weight."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.builtin_plugins.generation_vllm import VLLM_IMPORTS, vllm_memory
    from rlhf_plugins.models.memory import MemoryInputs

    shape = ModelShape(parameters=1000, layer_parameters=300, largest_tensor=400, vocab=50, hidden=8,
                       intermediate=16, layers=2, q_dim=8, kv_dim=4, tied=True)
    config, _, _ = prepare({"generation": {"backend": "vllm"}}, autoload=False)
    items = vllm_memory(MemoryInputs(config, shape, "generation", 1, 1000, 0, 0, sequences=3))
    assert items["weights"] == 4000 and items["sampler logits"] == 3 * 50 * 4 * 2 and items["imports"] == VLLM_IMPORTS
    assert items.get("packed output head", 0) == (0 if torch.cuda.is_available() else 50 * 8 * 4)


@pytest.mark.parametrize("shape", ["tiny", "reduced-qwen-tied"])
def test_the_builtin_loader_reads_tensor_by_tensor_what_from_pretrained_returns(tiny_model, shape, monkeypatch):
    """A whole load is built empty and read one tensor at a time (never the checkpoint mapped whole
    beside the model): the same tensors, buffers, tie, mode and generation settings as
    ``from_pretrained``; while DeepSpeed ZeRO-3 partitions loads, from_pretrained itself."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from rlhf_plugins.api import prepare
    from rlhf_plugins.models import empty_init

    path = tiny_model if shape == "tiny" else reduced_model_path()
    config, pm, _ = prepare({}, autoload=False)
    reads, real_fill = [], empty_init.fill
    monkeypatch.setattr(empty_init, "fill", lambda model: reads.append(model) or real_fill(model))
    ours = pm.load_model("actor", path, config)
    theirs = AutoModelForCausalLM.from_pretrained(path)
    assert reads == [ours] and not any(p.is_meta for p in ours.parameters())
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    tied = ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    assert tied == (shape != "tiny") == theirs.config.tie_word_embeddings
    assert not ours.training and ours.generation_config == theirs.generation_config
    keep = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert empty_init.build_empty(path, torch.float32, False) is None
    del keep


def test_the_logits_chunk_item_follows_how_the_model_computes_its_logits(tmp_path):
    """The actor's ``logits chunk``: 12 bytes per vocabulary entry for as many tokens as the 256 MB
    budget holds, also for a model that scales its logits (Granite: its chunks are the scaled hidden
    states' through the head); 16 for soft-capped logits (Gemma 2: the cap's slope is kept too)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhf_plugins.api import prepare
    from rlhf_plugins.models.tiny_model import default_model_path
    from rlhf_plugins.training.memory_plan import memory_plan

    vocab, budget = 32000, 256 * 2**20
    sizes = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    models = {"capped": ("gemma2", dict(head_dim=32)),  # final_logit_softcapping 30 by default
              "uncapped": ("gemma2", dict(head_dim=32, final_logit_softcapping=None)),
              "scaled": ("granite", dict(logits_scaling=8.0))}
    chunk = {}
    for name, (model_type, fields) in models.items():
        folder = tmp_path / name
        AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes, **fields)).save_pretrained(folder)
        AutoTokenizer.from_pretrained(default_model_path(quiet=True)).save_pretrained(folder)
        config, _, plan = prepare({"model": {"path": str(folder)}}, autoload=False)
        chunk[name] = memory_plan(config, plan).roles["actor"].parts["logits chunk"]
    assert chunk["uncapped"] == budget // (vocab * 12) * vocab * 12
    assert chunk["capped"] == budget // (vocab * 16) * vocab * 16
    assert chunk["scaled"] == chunk["uncapped"]
