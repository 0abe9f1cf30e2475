"""--learner.compile (rlhf_plugins.models.compiled): the torch learner's decoder norms and MLPs run as
torch.compile'd kernels and train as the eager learner does; learners and machines that cannot compile
say so in one line; TRL's torch_compile maps onto it."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from rlhf_plugins.errors import ConfigError
from rlhf_plugins.models.compiled import cpu_compiler
from tests.helpers import TINY_CHUNKS, WHOLE_LOGITS, compiled_learner_gaps, run_subprocess, short_run, torch_learner

pytestmark = pytest.mark.skipif(cpu_compiler() is None, reason="torch.compile on a CPU needs a C++ compiler")


def test_the_compiled_learner_trains_as_the_eager_one_in_float32():
    """Two updates on batches of other shapes: old log-probs, gradient norm and weights after each as
    the eager float32 learner's, to rounding; the norms and MLPs (and nothing else) run compiled."""
    from rlhf_plugins.models.compiled import compiled_blocks

    model = torch_learner("float32", compile=True).model
    names = sorted(n.rsplit(".", 1)[-1] for n in compiled_blocks(model))
    assert names == ["input_layernorm"] * 2 + ["mlp"] * 2 + ["norm"] + ["post_attention_layernorm"] * 2
    gaps = compiled_learner_gaps("float32")
    assert gaps["eager"] == {"logprobs": 0.0, "grad_norm": 0.0, "weights": 0.0}  # the yardstick is itself
    assert max(gaps["compiled"].values()) < 1e-4, gaps


def test_the_compiled_head_trains_as_the_eager_one_in_float32(monkeypatch):
    """A logits budget of a few tokens per chunk, so the fused head runs chunk by chunk: the compiled
    learner marks its head, the chunks' log-softmax and gradient run through the compiled functions,
    and old log-probs, gradient norm and weights stay the eager learner's to rounding."""
    from rlhf_plugins.models import fused_head
    from rlhf_plugins.models.logits import output_head

    assert getattr(output_head(torch_learner("float32", compile=True).model), fused_head.COMPILED)
    assert not getattr(output_head(torch_learner("float32").model), fused_head.COMPILED, False)
    ran = []
    compiled = fused_head._compiled
    monkeypatch.setattr(fused_head, "_compiled", lambda fn: ran.append(fn.__name__) or compiled(fn))
    gaps = compiled_learner_gaps("float32", logits_memory_mb=TINY_CHUNKS)
    assert {"_chunk_stats", "_chunk_grad"} <= set(ran)
    assert max(gaps["compiled"].values()) < 1e-4, gaps


@pytest.mark.parametrize("logits_mb", [WHOLE_LOGITS, TINY_CHUNKS], ids=["whole-logits", "chunked-head"])
def test_the_compiled_bf16_learner_is_as_close_to_float32_as_the_eager_one(logits_mb):
    """bf16 weights with float32 masters: the compiled learner keeps float32 inside its fused norms
    where eager torch rounds to bf16 between operations, so it cannot equal the eager bf16 learner; it
    stays at least as close to the float32 learner as that one does (its gradients reach the masters
    through the compiled backward: a lost gradient would leave the weights far off). With the head in
    chunks its compiled gradient reaches the head's float32 master directly."""
    gaps = compiled_learner_gaps("bfloat16", logits_memory_mb=logits_mb)
    for key, eager in gaps["eager"].items():
        assert 0 < gaps["compiled"][key] <= 1.5 * eager, (key, gaps)


def _recompile_reasons(run: Any) -> list[str]:
    """What dynamo printed for each recompilation during ``run()`` (its ``recompiles`` log)."""
    import logging

    import torch

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("torch._dynamo.guards.__recompiles")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    try:
        run()
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    return seen


def test_whole_decoder_layers_compile_once_for_all_layers_and_train_as_the_eager_learner():
    """--learner.compile_scope layers: each decoder layer is compiled whole (and the final norm, the
    one block outside them), the two updates in float32 stay the eager learner's to rounding, and
    no version was compiled for a layer's index or a KV cache layer's state: the recompilations
    there are (shared prompt or not, gradient or not) hold for every layer at once."""
    from rlhf_plugins.models.compiled import compiled_blocks

    model = torch_learner("float32", compile=True, compile_scope="layers").model
    assert compiled_blocks(model) == ["model.layers.0", "model.layers.1", "model.norm"]
    gaps: dict = {}
    reasons = _recompile_reasons(lambda: gaps.update(compiled_learner_gaps("float32", compile_scope="layers")))
    assert max(gaps["compiled"].values()) < 1e-4, gaps
    assert reasons, "the shared-prompt and the full forward compile apart; the log saw neither"
    per_layer = [r for r in reasons if "layer_idx" in r or "layers[" in r]
    assert not per_layer, per_layer[0]


def test_a_mixture_of_experts_keeps_its_routing_eager_and_its_dense_layer_compiles_whole():
    """Qwen3-MoE with layer 0 dense (``mlp_only_layers``): under ``layers`` layer 0 is compiled whole,
    layer 1 (a sparse block: data-dependent routing) keeps its block eager with its norms compiled;
    under ``blocks`` the dense MLP and every norm are compiled, the sparse block is not."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_plugins.models.compiled import compile_blocks, compiled_blocks

    config = AutoConfig.for_model("qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                                  moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, mlp_only_layers=[0])
    norms = ["input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"]
    want = {"layers": ["model.layers.0", *(f"model.layers.1.{n}" for n in norms), "model.norm"],
            "blocks": [*(f"model.layers.0.{n}" for n in ("self_attn.q_norm", "self_attn.k_norm", "mlp",
                                                          "input_layernorm", "post_attention_layernorm")),
                       *(f"model.layers.1.{n}" for n in norms), "model.norm"]}
    for scope, names in want.items():
        model = AutoModelForCausalLM.from_config(config)
        compile_blocks(model, torch.device("cpu"), scope=scope)
        assert type(model.model.layers[1].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
        assert sorted(compiled_blocks(model)) == sorted(names), scope


def test_a_learner_that_does_not_compile_refuses_the_flag():
    pytest.importorskip("deepspeed")
    from rlhf_plugins.api import prepare

    with pytest.raises(ConfigError, match="the 'deepspeed' learner does not compile its model; use "
                                          "--learner.backend torch \\(or fsdp\\) or drop --learner.compile"):
        prepare({"learner": {"backend": "deepspeed", "compile": True}}, autoload=False)


@pytest.mark.parametrize("name,value", [("compile_scope", "layers"), ("compile_mode", "reduce-overhead")])
def test_a_compile_scope_or_mode_without_compile_is_refused(name, value):
    from rlhf_plugins.api import prepare

    with pytest.raises(ConfigError, match=f"^learner.{name} {value} says how --learner.compile compiles; add "
                                          f"--learner.compile true or drop --learner.{name}$"):
        prepare({"learner": {name: value}}, autoload=False)


def test_cuda_graph_modes_are_refused_by_the_fsdp_learner_and_other_modes_are_not():
    from rlhf_plugins.api import prepare

    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(ConfigError, match=f"^learner.compile_mode {mode} replays CUDA graphs, which the 'fsdp' "
                                              "learner does not allow"):
            prepare({"learner": {"backend": "fsdp", "compile": True, "compile_mode": mode}}, autoload=False)
    config, _, plan = prepare({"learner": {"backend": "fsdp", "compile": True,
                                           "compile_mode": "max-autotune-no-cudagraphs"}}, autoload=False)
    assert config.learner.compile_mode == "max-autotune-no-cudagraphs" and not plan.learner.graphs
    assert prepare({"learner": {"compile": True, "compile_mode": "reduce-overhead"}}, autoload=False)[2].learner.graphs


class _Gated(torch.nn.Module):
    """A module of this test's own (its code compiled nowhere else in the process)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.proj(x)) * x


def test_with_cuda_graphs_only_calls_under_autograd_run_the_graphed_code():
    """A module compiled in ``reduce-overhead`` mode: a call without gradients runs code compiled
    without CUDA graphs, one under autograd the code that asks inductor for them (on a CPU inductor
    then counts a skipped graph: the request reached it); both compute what the eager module does."""
    from torch._dynamo.utils import counters

    from rlhf_plugins.models.compiled import _compile

    torch.manual_seed(0)
    module, x = _Gated(), torch.randn(5, 8)
    want = module(x)
    _compile(module, "reduce-overhead")
    counters.clear()
    with torch.no_grad():
        torch.testing.assert_close(module(x), want)
    assert counters["stats"]["unique_graphs"] == 1 and counters["inductor"]["cudagraph_skips"] == 0
    got = module(x.requires_grad_())
    torch.testing.assert_close(got, want)
    assert counters["stats"]["unique_graphs"] >= 2 and counters["inductor"]["cudagraph_skips"] >= 1
    got.sum().backward()
    assert module.proj.weight.grad is not None and x.grad is not None


def test_cuda_graph_modes_on_a_cpu_compile_without_graphs_and_say_so(caplog):
    """On a CPU ``--learner.compile_mode reduce-overhead`` says in one line that CUDA graphs need a
    GPU and compiles in the default mode (no graph requested of inductor): the learner's log-probs
    are the eager learner's."""
    from torch._dynamo.utils import counters

    from tests.helpers import ppo_batch, ppo_update

    torch._dynamo.reset()  # compiled afresh: the counters below see this learner's compilation
    counters.clear()
    with caplog.at_level("WARNING", logger="rlhf_plugins"):
        learner = torch_learner("float32", compile=True, compile_mode="reduce-overhead")
    assert [r.getMessage() for r in caplog.records if "compile_mode" in r.getMessage()] == [
        "learner.compile_mode reduce-overhead: CUDA graphs need a GPU; on the CPU the compiled modules run without them"]
    batch = ppo_batch(3)
    got = learner.logprobs(batch)
    want = torch_learner("float32").logprobs(batch)
    assert float((got - want).abs()[batch["action_mask"].bool()].max()) < 1e-5
    batch["old_logprobs"] = got
    assert ppo_update(learner, batch)["grad_norm"] > 0  # a training forward and backward, under autograd
    assert counters["stats"]["unique_graphs"] >= 2 and counters["inductor"]["cudagraph_skips"] == 0


def test_with_cuda_graphs_gradients_accumulate_in_place_in_tensors_allocated_before_the_backward():
    """A CUDA-graph mode with float32 weights: every trainable parameter has its gradient before the
    first backward, and each micro batch's backward of two updates adds to that very tensor (autograd
    never makes a compiled backward's output the gradient, which on a GPU the next micro batch's
    graphs would overwrite: run 7 in docs/gpu.md); the updates equal the eager learner's, whose
    gradients are still freed after each update."""
    from tests.helpers import ppo_batch, ppo_update

    learner, eager = torch_learner("float32", compile=True, compile_mode="reduce-overhead"), torch_learner("float32")
    params = [p for group in learner.optimizer.param_groups for p in group["params"]]
    assert all(p.grad is not None and not p.grad.any() for p in params)
    allocated = {id(p): p.grad.data_ptr() for p in params}
    accumulated: list[bool] = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.data_ptr() == allocated[id(p)]))
    for seed in (3, 4):
        batch = ppo_batch(seed)
        batch["old_logprobs"] = eager.logprobs(batch)
        got, want = ppo_update(learner, batch)["grad_norm"], ppo_update(eager, batch)["grad_norm"]
        assert abs(got - want) <= 1e-5 * want
    assert len(accumulated) == 2 * 2 * len(params) and all(accumulated)  # two micro batches per update
    assert all(p.grad is not None and not p.grad.any() for p in params)  # zeroed, kept
    assert all(p.grad is None for p in eager.model.parameters())
    for a, b in zip(learner.model.parameters(), eager.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_without_a_cpu_compiler_the_run_stops_in_one_line(tmp_path):
    """PATH without any C++ compiler: exit 2, one line naming the fix, no run folder left behind."""
    import os
    import sys

    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    proc = run_subprocess("train", *short_run("--learner.compile", "true"), cwd=tmp_path,
                          env={"PATH": str(bare), "RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == ("rlhf: error: learner.compile on a CPU needs a C++ compiler "
                                                    "(torch.compile writes C++ kernels): install g++ or drop "
                                                    "--learner.compile")
    assert not (tmp_path / "runs").exists() or not os.listdir(tmp_path / "runs")


def test_trl_torch_compile_turns_it_on_and_liger_is_a_note():
    pytest.importorskip("trl")
    from rlhf_plugins.integrations.trl import from_grpo_fields

    raw, notes = from_grpo_fields({"torch_compile": True})
    assert raw["learner"]["compile"] is True and notes == []
    raw, notes = from_grpo_fields({"torch_compile_mode": "reduce-overhead"})  # the Trainer compiles then too
    assert raw["learner"]["compile"] is True and raw["learner"]["compile_mode"] == "reduce-overhead" and notes == []
    for mode in ("max-autotune", "max-autotune-no-cudagraphs"):  # every mode torch.compile has but its default
        assert from_grpo_fields({"torch_compile_mode": mode})[0]["learner"]["compile_mode"] == mode
    raw, notes = from_grpo_fields({"torch_compile_mode": "fastest"})
    assert "compile_mode" not in raw["learner"] and notes == [
        "TRL field 'torch_compile_mode' ('fastest') is ignored: torch.compile has no such mode; --learner.compile "
        "runs inductor's default mode"]
    raw, notes = from_grpo_fields({"torch_compile_backend": "aot_eager"})
    assert raw["learner"]["compile"] is True and "compile_mode" not in raw["learner"]
    assert notes == ["TRL field 'torch_compile_backend' ('aot_eager') is ignored: --learner.compile compiles the "
                     "decoder's norms, MLPs and head's log-softmax with inductor"]
    raw, notes = from_grpo_fields({"use_liger_kernel": True})
    assert "compile" not in raw.get("learner", {})
    assert [n for n in notes if "use_liger_kernel" in n] == [
        "TRL field 'use_liger_kernel' is ignored: the output head, log-softmax and gather already run as one fused, "
        "chunked function; --learner.compile fuses the norms and MLPs Liger's other kernels cover"]


def test_with_cuda_graphs_a_16_bit_learners_float32_parameters_keep_their_gradients_allocated():
    """bf16 weights with float32 masters and a float32 head (--model.fp32_lm_head: its own master, no
    master to move its gradient out of the graphs' pool): under a CUDA-graph mode the head's gradient
    exists before the first backward and stays the same tensor, zeroed after each update."""
    from tests.helpers import ppo_batch, ppo_update

    learner = torch_learner("bfloat16", fp32_lm_head=True, compile=True, compile_mode="reduce-overhead")
    head = learner.model.get_output_embeddings().weight
    assert head.dtype == torch.float32 and head.grad is not None and not head.grad.any()
    allocated, before = head.grad.data_ptr(), head.detach().clone()
    for seed in (3, 4):
        assert ppo_update(learner, ppo_batch(seed))["grad_norm"] > 0
        assert head.grad.data_ptr() == allocated and not head.grad.any()
    assert not torch.equal(head, before)


def test_a_compile_error_wrapped_by_ray_is_recognised_and_summed_up_in_its_compilers_first_error():
    """What a role's torch.compile raises (dynamo's wrapper around inductor's C++ compile error, around
    the compiler's exit status) reaches the driver inside Ray's RayTaskError: still a compile failure,
    told by the C++ compile error's first line and the compiler's first error, not by the command."""
    import ray.exceptions
    from torch._inductor.exc import CppCompileError

    from rlhf_plugins.training.compile_failure import is_compile_failure, what_failed
    from tests.helpers import raise_cpp_compile_error

    try:
        raise_cpp_compile_error("k.cpp: In function 'void kernel()':\nk.cpp:86:45: error: 'at::vec' has not been "
                                "declared\nmore")
    except CppCompileError as raised:
        compile_error = raised
    wrapped = ray.exceptions.RayTaskError("call_function", "Traceback ...", compile_error).as_instanceof_cause()
    assert is_compile_failure(wrapped) and is_compile_failure(compile_error)
    assert what_failed(wrapped) == "CppCompileError: C++ compile error ('at::vec' has not been declared)"
    assert not is_compile_failure(RuntimeError("C++ compile error"))  # told by the exception's type, not its text


def test_a_half_written_compile_cache_stops_the_run_in_one_line_and_deleting_it_mends_it(tmp_path):
    """A run killed while torch.compile wrote its kernels leaves them half-written in the cache, which
    torch trusts: the next compiled run stops with exit 1 and one line naming the role, the compiler's
    error, the cache folder and the flag, leaves no run folder; deleting the folder, as the line says,
    lets the next run train."""
    import shutil

    cache = tmp_path / "inductor"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"}
    flags = short_run("--learner.compile", "true", "--train.steps", "1")
    (tmp_path / "a").mkdir()
    first = run_subprocess("train", *flags, cwd=tmp_path / "a", env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    kernels = list(cache.rglob("*.so"))
    assert kernels
    for kernel in kernels:  # what a kill in the middle of writing them leaves
        kernel.write_bytes(kernel.read_bytes()[:100])
    (tmp_path / "b").mkdir()
    broken = run_subprocess("train", *flags, cwd=tmp_path / "b", env=env)
    assert broken.returncode == 1, broken.stderr[-2000:]
    last = broken.stderr.strip().splitlines()[-1]
    assert last.startswith("rlhf: error: torch.compile failed in role 'actor' -- "), last
    assert f"if a run was killed while compiling, torch's cache ({cache}" in last and "delete" in last, last
    assert last.endswith("; or run without --learner.compile (-v shows the traceback)"), last
    assert "Traceback" not in broken.stderr
    assert not list((tmp_path / "b" / "runs").glob("*"))
    shutil.rmtree(cache)
    mended = run_subprocess("train", *flags, cwd=tmp_path / "b", env=env)
    assert mended.returncode == 0, mended.stderr[-2000:]
