"""A real vocabulary through every execution path, in CI: a random-weight Qwen2.5 shape reduced to
two narrow layers (151,936 tokens, tied embeddings, grouped-query attention) trains two steps locally
with chunked logits, with vLLM, and in the seeds' production layout (Ray, DeepSpeed ZeRO-3 over two
ranks, a reference, vLLM, broadcast sync); reduced Qwen3-30B-A3B, gpt-oss-20b and Mixtral-8x7B (mixtures of experts)
sync into vLLM, and a reduced OLMo-2 (served by vLLM with transformers' classes) trains beside it. The
full-size runs are bench/scale.py's."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlhf_plugins.models.memory import ModelShape
from rlhf_plugins.testing import reduced_model_path
from tests.helpers import metrics_of, the_run

pytest.importorskip("vllm")

STEPS = ["--train.steps", "2", "--train.prompts_per_step", "4", "--generation.n_samples_per_prompt", "4",
         "--generation.max_new_tokens", "6", "--data.max_prompt_tokens", "32", "--eval.enabled", "false",
         "--train.progress", "false"]


@pytest.fixture(scope="module")
def reduced() -> str:
    path = reduced_model_path()
    shape = ModelShape.of_folder(path)
    assert shape.vocab == 151936 and shape.tied and shape.kv_dim < shape.q_dim
    return path


def _ran(rows: list[dict], roles: tuple[str, ...]) -> None:
    assert len(rows) == 2
    for row in rows:
        assert all(row[f"memory/{r}_rss_gb"] > 0 for r in roles)
        assert row["kl"] == row["kl"] and row["loss/policy"] == row["loss/policy"]  # finite, not NaN


def test_local_path_with_chunked_logits(rlhf, reduced):
    """Eight tokens of logits per chunk: the reference and the learner go through the chunked head."""
    code, out, err = rlhf("train", "--model.path", reduced, "--learner.logits_memory_mb", "14", *STEPS)
    assert code == 0, err
    assert "logits chunk 14 MB" in out
    _ran(metrics_of(the_run()), ("generation", "actor", "reference"))


@pytest.mark.integration
def test_local_path_with_vllm(rlhf, reduced):
    code, out, err = rlhf("train", "--model.path", reduced, "--generation.backend", "vllm", "--sync.verify", "true",
                          *STEPS)
    assert code == 0, err
    assert "KV cache (reserved)" in out  # sized from the run, not from the machine's free memory
    _ran(metrics_of(the_run()), ("generation", "actor", "reference"))


@pytest.mark.integration
def test_a_mixture_of_experts_trains_with_vllm_in_parity(rlhf):
    """The reduced Qwen3-30B-A3B through the plan, the torch learner (gradients through transformers'
    experts) and vLLM with in-process sync, checked against the learner after every sync."""
    path = reduced_model_path("qwen3-30b-a3b")
    code, out, err = rlhf("train", "--model.path", path, "--generation.backend", "vllm", "--sync.verify", "true",
                          *STEPS)
    assert code == 0, err
    rows = metrics_of(the_run())
    _ran(rows, ("generation", "actor", "reference"))
    assert all(r["mismatch/abs_log_ratio"] < 1e-5 for r in rows)


def test_zero3_with_lora_on_the_experts_is_refused_in_one_line(rlhf):
    """DeepSpeed ZeRO-3 cannot reduce the gradients of PEFT's LoRA on fused expert tensors: exit 2, one
    line naming the tensor and the ways that train (ZeRO-2, FSDP2, LoRA off the experts), no run left."""
    from pathlib import Path

    pytest.importorskip("deepspeed")
    code, _, err = rlhf("train", "--model.path", reduced_model_path("qwen3-30b-a3b"), "--learner.backend", "deepspeed",
                        "--deepspeed.zero_stage", "3", "--lora.rank", "4", *STEPS)
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("rlhf: error: LoRA on a mixture of experts' fused expert tensors (model.layers.")
    assert "--deepspeed.zero_stage 2" in line and "--lora.target_modules q_proj,k_proj,v_proj,o_proj" in line
    assert not Path("runs").exists() or not any(Path("runs").iterdir())


@pytest.mark.integration
def test_the_seeds_production_layout(local_ray, rlhf, reduced):
    """Ray + DeepSpeed ZeRO-3 x 2 ranks + reference + vLLM with broadcast sync: each role in its own
    process, each reporting its peak, the engine matching the learner after every sync."""
    code, out, err = rlhf("train", "--model.path", reduced, "--placement.strategy", "ray", "--learner.backend",
                          "deepspeed", "--deepspeed.zero_stage", "3", "--ray.actor_workers", "2",
                          "--generation.backend", "vllm", "--sync.verify", "true", *STEPS)
    assert code == 0, err
    assert "[actor x2] actor" in out
    rows = metrics_of(the_run())
    _ran(rows, ("generation", "actor", "reference", "reward"))
    assert rows[-1]["memory/generation_rss_gb"] != rows[-1]["memory/actor_rss_gb"]  # separate processes


@pytest.mark.integration
def test_a_tied_output_head_follows_every_sync_into_vllm(reduced):
    """Tied embeddings: the learners send the embedding alone (no lm_head tensor); vLLM's output head
    must follow it on every sync -- whole and part by part -- not keep what it derived from the
    checkpoint's (vLLM's CPU build packs the head's weight for its kernels)."""
    _follows_every_sync_into_vllm(reduced)


@pytest.mark.integration
def test_a_mixture_of_experts_follows_every_sync_into_vllm():
    """A reduced Qwen3-30B-A3B (128 experts, 8 per token): the learner sends transformers' fused
    expert tensors (``experts.gate_up_proj``, ``experts.down_proj``), which the engine must accept by
    name and load so that it samples from the learner's experts. vLLM's CPU expert kernel packs the
    expert weights at start and its reload left new weights unpacked: log-probs off by 0.1."""
    path = reduced_model_path("qwen3-30b-a3b")
    shape = ModelShape.of_folder(path)
    assert shape.vocab == 151936 and not shape.tied
    _follows_every_sync_into_vllm(path)


@pytest.mark.integration
def test_gpt_oss_follows_every_sync_into_vllm():
    """A reduced gpt-oss-20b: vLLM's loader for it copies attention sinks and the experts' weights
    and biases into the parameters itself, past the loaders vLLM's in-place reload watches, so a
    reload left them as they were (log-probs off by 0.3 after one step of training, no error); they
    must land on every sync, whole and part by part."""
    path = reduced_model_path("gpt-oss-20b")
    shape = ModelShape.of_folder(path)
    assert shape.vocab == 201088 and shape.experts == 32 and not shape.tied
    _follows_every_sync_into_vllm(path)


@pytest.mark.integration
def test_mixtral_follows_every_sync_into_vllm():
    """A reduced Mixtral-8x7B: transformers renames its checkpoint's ``block_sparse_moe`` to ``mlp`` and
    fuses the per-expert ``w1`` / ``w3`` / ``w2`` when it loads, so a learner sends names vLLM's Mixtral
    loader does not know ("no module or parameter named 'layers.0.mlp'" at the first sync); the
    engine loads the checkpoint's names instead, whole and part by part."""
    path = reduced_model_path("mixtral-8x7b")
    shape = ModelShape.of_folder(path)
    assert shape.vocab == 32000 and (shape.experts, shape.experts_per_token) == (8, 2) and not shape.tied
    _follows_every_sync_into_vllm(path)


@pytest.mark.integration
def test_an_engine_running_transformers_code_keeps_an_moe_vllm_computes_otherwise_in_parity():
    """A reduced Qwen1.5-MoE-A2.7B (a gated shared expert beside 60 routed ones): vLLM 0.32's own
    implementation computes it differently from transformers on CPU (log-probs 0.4 apart before any
    sync); with --vllm.model_impl transformers the engine runs transformers' classes under vLLM and
    follows every sync, whole and part by part, in parity."""
    path = reduced_model_path("qwen1.5-moe-a2.7b")
    assert ModelShape.of_folder(path).experts == 60
    engine_model = _follows_every_sync_into_vllm(path, model_impl="transformers")
    assert "Transformers" in engine_model.__name__  # vLLM's Transformers backend, not its Qwen2MoeForCausalLM


def test_synced_names_become_the_checkpoints_in_their_order_one_layer_at_a_time():
    """What a learner of a reduced Mixtral sends, turned into the checkpoint's names: every checkpoint
    tensor once, equal to the slice of the fused tensor it came from (the down projections views of
    it); a name the checkpoint has passes as it is, in its place; and the turning is lazy: taking the
    first tensor turns nothing yet."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.engines.vllm_names import CheckpointNames
    from rlhf_plugins.models.weights import checkpoint_shapes

    path = reduced_model_path("mixtral-8x7b")
    model = AutoModelForCausalLM.from_pretrained(path)
    sent = list(model.state_dict().items())
    names = CheckpointNames(path)
    stream = names(sent)
    assert next(stream)[0] == sent[0][0] == "model.embed_tokens.weight" and names._model is None
    got = [(sent[0][0], sent[0][1]), *stream]
    order = [n for n, _ in got]
    assert sorted(order) == sorted(checkpoint_shapes(path)) and len(set(order)) == len(order)
    assert order[-1] == sent[-1][0] == "lm_head.weight"
    gate_up, down = (dict(sent)[f"model.layers.1.mlp.experts.{n}"] for n in ("gate_up_proj", "down_proj"))
    width, tensors = gate_up.shape[1] // 2, dict(got)
    for expert in (0, 7):
        moe = f"model.layers.1.block_sparse_moe.experts.{expert}"
        assert torch.equal(tensors[f"{moe}.w1.weight"], gate_up[expert, :width])
        assert torch.equal(tensors[f"{moe}.w3.weight"], gate_up[expert, width:])
        w2 = tensors[f"{moe}.w2.weight"]
        assert torch.equal(w2, down[expert]) and w2.untyped_storage().data_ptr() == down.untyped_storage().data_ptr()
    assert torch.equal(tensors["model.layers.0.block_sparse_moe.gate.weight"], dict(sent)["model.layers.0.mlp.gate.weight"])


@pytest.mark.integration
def test_an_architecture_vllm_serves_with_transformers_classes_trains_beside_the_engine(rlhf):
    """OLMo-2: vLLM serves it through its Transformers backend, which patches transformers'
    ``Olmo2Model`` class for its compiler. The learner and the reference in the same process build that
    class too (before the fix: "Current vLLM config is not set" at the learner's start); after the
    engine starts the class is as transformers defines it, and the run keeps engine and learner in
    parity."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2Model

    bases = Olmo2Model.__bases__
    code, out, err = rlhf("train", "--model.path", reduced_model_path("olmo-2-1b"), "--generation.backend", "vllm",
                          "--sync.verify", "true", *STEPS)
    assert code == 0, err
    assert Olmo2Model.__bases__ == bases and "__call__" not in vars(Olmo2Model)
    rows = metrics_of(the_run())
    _ran(rows, ("generation", "actor", "reference"))
    assert all(r["mismatch/abs_log_ratio"] < 1e-5 for r in rows)


@pytest.mark.integration
def test_adapter_sync_of_a_mixture_of_experts_on_cpu_says_to_sync_merged_weights(rlhf):
    """vLLM applies LoRA to expert layers with Triton kernels, which its CPU build lacks: its own error
    ("module 'triton.language' has no attribute 'float32'") gains what to do instead."""
    code, _, err = rlhf("train", "--model.path", reduced_model_path("gpt-oss-20b"), "--generation.backend", "vllm",
                        "--lora.rank", "8", "--sync.method", "adapter", *STEPS)
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert "vLLM could not start an engine" in line and "drop --sync.method adapter" in line, err
    assert not Path("runs").exists() or not any(Path("runs").iterdir())  # no half-made run left


def test_class_patches_are_confined_to_the_engines_own_instances():
    """What a decoration adds to a class (a base, a ``__call__``) moves to a subclass that only the
    engine's instance takes: models built before and after behave as the class defines them."""
    import torch

    from rlhf_plugins.engines.vllm_classes import confine, reclass, snapshot

    class Compiler:
        def compiled(self) -> str:
            return "compiled"

    class Decoder(torch.nn.Module):
        def forward(self, x: int) -> int:
            return x + 1

    built_before, engines = Decoder(), Decoder()
    before = snapshot([Decoder])
    Decoder.__bases__ += (Compiler,)
    Decoder.__call__ = lambda self, x: "patched"
    moved = confine(before)
    assert reclass(torch.nn.Sequential(engines), moved) == 1
    assert engines(1) == "patched" and engines.compiled() == "compiled" and isinstance(engines, Decoder)
    assert built_before(1) == 2 and Decoder()(1) == 2 and Compiler not in Decoder.__mro__
    assert confine(snapshot([Decoder])) == {}  # nothing changed since: nothing moved



@pytest.mark.parametrize("order", ["loader-then-copy", "copy-then-loader", "copies-only"])
def test_a_layer_mixing_loader_loads_and_direct_copies_stops_the_sync_in_one_line(order):
    """vLLM's reload of a layer taken out for direct copies (gpt-oss's experts) would lose a tensor
    of the same layer loaded through its weight loader (buffered before the take-out, dropped after):
    the sync stops naming the layer and both tensors. Copies alone land, and the layer's loaders are
    its own again once the sync ends."""
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import (
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from rlhf_plugins.engines.vllm_reload import DirectCopies, process_taken
    from rlhf_plugins.models.weights import WeightSyncError

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = (torch.nn.Parameter(torch.zeros(3), requires_grad=False) for _ in range(2))
            self.up.weight_loader = self.down.weight_loader = default_weight_loader

    model = torch.nn.Sequential(Experts())
    record_metadata_for_reloading(model)
    initialize_layerwise_reload(model)
    up, down = model[0].up, model[0].down  # the meta placeholders a load_weights looks up
    taken: list[torch.nn.Module] = []
    with DirectCopies(model, taken):
        if order == "copies-only":
            up.data.copy_(torch.full((3,), 7.0))
            down.copy_(torch.full((3,), 2.0))
        else:
            with pytest.raises(WeightSyncError) as err:
                if order == "loader-then-copy":
                    up.weight_loader(up, torch.ones(3))
                down.copy_(torch.full((3,), 2.0))
                up.weight_loader(up, torch.ones(3))
            assert "layer '0' (Experts) gets up through its weight loaders and down by a direct copy" in str(err.value)
            return
    assert process_taken(taken) == 0 and taken == []
    assert model[0].up.tolist() == [7.0] * 3 and model[0].down.tolist() == [2.0] * 3
    assert model[0].up.weight_loader is default_weight_loader and model[0].down.weight_loader is default_weight_loader
    initialize_layerwise_reload(model)  # the next sync: vLLM registers the same placeholders again
    with DirectCopies(model, taken):
        for param, value in ((model[0].up, 1.0), (model[0].down, 3.0)):
            param.weight_loader(param, torch.full((3,), value))  # through vLLM's own reload, not refused
    assert taken == [] and model[0].up.tolist() == [1.0] * 3 and model[0].down.tolist() == [3.0] * 3

def _follows_every_sync_into_vllm(path: str, **vllm: str) -> Any:
    """Perturb every weight of a transformers copy of ``path``, sync it into a vLLM engine (``vllm``:
    its options) whole, then again part by part (broadcast's buckets), under the names a learner
    sends (a tied tensor once); each time the engine's log-probs of its own samples equal the copy's.
    Returns the class of the engine's model."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_plugins import SamplingParams
    from rlhf_plugins.api import prepare
    from rlhf_plugins.engines.vllm_engine import VLLMEngine
    from rlhf_plugins.models.weights import tied_aliases
    from rlhf_plugins.sync import verify_parity
    from rlhf_plugins.sync.broadcast import buckets, check_names, commit_worker, receive
    from rlhf_plugins.testing import backend_context
    from tests.helpers import Actor, batch_of, prompts

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    config, pm, _ = prepare({"generation": {"backend": "vllm"}, "model": {"path": path}, "vllm": vllm}, autoload=False)
    engine = VLLMEngine(backend_context(config, "generation", path, pm))
    try:
        model = AutoModelForCausalLM.from_pretrained(path)
        aliases = tied_aliases(model)
        ids = prompts(path)
        for part_by_part in (False, True):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
            named = [(n, t) for n, t in model.state_dict().items() if n not in aliases]
            check_names({n: (tuple(t.shape), str(t.dtype)) for n, t in named}, engine.weight_shapes())
            if part_by_part:
                for bucket, parts in buckets(iter(named), 2**20):
                    engine.model_workers(receive, list(bucket.unpack(torch.cat(parts))))
                engine.model_workers(commit_worker)
            else:
                engine.load_weights(named)
            batch = batch_of(ids, engine.generate(ids, SamplingParams(n=2, max_new_tokens=4, seed=1)), 2)
            assert verify_parity(Actor(model), engine, batch) < 1e-4
        return engine.model_workers(lambda worker: type(worker.worker.model_runner.get_model()))[0]
    finally:
        engine.shutdown()
