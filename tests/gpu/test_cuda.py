"""The CUDA path, for real on a lent GPU (scripts/device_check.sh): bf16 GRPO with the torch learner,
the transformers engine, CUDA IPC and in-process weight sync, DeepSpeed ZeRO-2/3 on one GPU, the
compiled learner (Triton), LoRA,
checkpoint + resume, and a Qwen2.5-0.5B-shaped model's peak GPU memory against its analytic need.
Figures worth keeping are recorded with ``report`` and land in the device check's JSON."""
from __future__ import annotations

import json
import os

import pytest
import torch

from rlhf_plugins.api import prepare
from rlhf_plugins.training.runlog import MEASURED
from tests.helpers import (
    TINY_CHUNKS,
    WHOLE_LOGITS,
    assert_same_samples,
    bucketed_and_per_parameter_learners,
    compiled_learner_gaps,
    cuda_graph_gaps,
    ppo_batch,
    ppo_update,
    random_batch,
    torch_learner,
)

#: "cpu" runs these bodies on the CPU (to check the tests themselves without a GPU); CUDA-only checks
#: (NCCL, CUDA IPC) then expect their CPU twins (gloo, shared memory)
DEVICE = os.environ.get("RLHF_GPU_TESTS_DEVICE", "cuda")


def trainer(raw: dict, model_path: str | None = None):
    from transformers import AutoTokenizer

    from rlhf_plugins.data.prompts import load_prompts
    from rlhf_plugins.models.tiny_model import default_model_path
    from rlhf_plugins.training.loop import Trainer

    path = model_path or default_model_path()
    config, pm, plan = prepare({**raw, "model": {**raw.get("model", {}), "path": path}}, autoload=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return Trainer(config, pm, plan, load_prompts(config.data, tokenizer), tokenizer, path)


def run_steps(t, steps: int) -> list[dict]:
    t.setup()
    try:
        return [t.step(s) for s in range(steps)]
    finally:
        t.shutdown()


def test_grpo_in_bf16_learns_on_cuda_with_float32_optimizer_states(report):
    t = trainer({"model": {"dtype": "bfloat16"}, "train": {"steps": 60}, "eval": {"enabled": False}})
    t.setup()
    try:
        rows = [t.step(s) for s in range(60)]
        learner = t.actor.learner
        masters = [p for group in learner.optimizer.param_groups for p in group["params"]]
        assert masters and all(p.device.type == DEVICE and p.dtype == torch.float32 for p in masters)
        assert all(p.device.type == DEVICE and p.dtype == torch.bfloat16 for p in learner.model.parameters())
        states = [s for st in learner.optimizer.state.values() for s in st.values() if torch.is_tensor(s) and s.dim()]
        assert states and all(s.dtype == torch.float32 and s.device.type == DEVICE for s in states)
        engine = t.engine.engine.model
        assert all(p.device.type == DEVICE and p.dtype == torch.bfloat16 for p in engine.parameters())
    finally:
        t.shutdown()
    first, last = (sum(r["reward/mean"] for r in rows[i:i + 6]) / 6 for i in (0, 54))
    report("bf16_reward_first_last", [round(first, 3), round(last, 3)])
    report("bf16_seconds_per_step", sum(r["time/step"] for r in rows[5:]) / 55)
    assert last - first > 0.1, (first, last)
    assert all("memory/actor_gpu_gb" in r for r in rows) or DEVICE == "cpu"


@pytest.mark.parametrize("dtype, fp32_head, bound", [("float32", False, 1e-3), ("bfloat16", False, 0.1),
                                                     ("bfloat16", True, 0.1)])
def test_the_engine_samples_what_the_learner_recomputes(report, dtype, fp32_head, bound):
    """Log-probs of the engine's own samples against the learner's recomputation on the GPU; also with
    --model.fp32_lm_head (float32 heads in both, on the card, the decoder in bf16)."""
    from rlhf_plugins.training.rollout import make_batch

    t = trainer({"model": {"dtype": dtype, "fp32_lm_head": fp32_head}, "train": {"prompts_per_step": 16},
                 "eval": {"enabled": False}})
    t.setup()
    try:
        assert t.engine.engine.device.type == DEVICE
        if fp32_head:
            for model in (t.actor.learner.model, t.engine.engine.model):
                head = model.get_output_embeddings().weight
                assert head.dtype == torch.float32 and head.device.type == DEVICE
                assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
        batch = make_batch(t.generate(0), t.pad_id)
        learner = t.actor.logprobs(batch)
        mask = batch["action_mask"].bool()
        gap = float((learner - batch["rollout_logprobs"]).abs()[mask].max())
    finally:
        t.shutdown()
    report(f"engine_learner_gap_{dtype}{'_fp32_head' if fp32_head else ''}", gap)
    assert gap < bound


def _open_and_check(handle: bytes, queue, written) -> None:
    """In the child: open the handle, report what it sees, wait for the parent's write, report again."""
    from rlhf_plugins.sync.ipc import open_handle

    tensor = open_handle(handle)
    queue.put((tuple(tensor.shape), float(tensor.sum()), tensor.device.type))
    written.wait(timeout=60)
    queue.put(float(tensor.sum()))


def test_cuda_ipc_handles_alias_the_senders_memory_in_another_process(report):
    """torch.multiprocessing, no Ray: the child opens the handle, sees the sender's values, and a later
    write by the sender reaches it without any copy."""
    import torch.multiprocessing as mp

    from rlhf_plugins.sync.ipc import ipc_handle, shared_cpu_buffer

    ctx = mp.get_context("spawn")
    if DEVICE == "cpu":  # the CPU twin: a shared-memory file of our own, as the IPC sync makes on CPUs
        buf, handle, path = shared_cpu_buffer(1024, torch.float32)
        buf.copy_(torch.arange(1024, dtype=torch.float32))
    else:
        buf = torch.arange(1024, dtype=torch.float32, device=DEVICE)
        handle, path = ipc_handle(buf), None
    queue, written = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_open_and_check, args=(handle, queue, written))
    child.start()
    shape, total, device = queue.get(timeout=120)
    buf.add_(1.0)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    written.set()
    later = queue.get(timeout=60)
    child.join(timeout=60)
    if path is not None:
        path.unlink()
    assert shape == (1024,) and device == DEVICE and total == float(sum(range(1024)))
    assert later == total + 1024  # the sender's write, seen through the same memory
    report("ipc_alias", True)


def test_in_process_sync_shares_the_learners_cuda_parameters():
    t = trainer({"train": {"prompts_per_step": 8}, "sync": {"verify": True}, "eval": {"enabled": False}})
    t.setup()
    try:
        assert t.sync.shared
        live = dict(t.actor.live_weights())
        engine = dict(t.engine.engine.model.named_parameters())
        assert all(live[n].data_ptr() == engine[n].data_ptr() and live[n].device.type == DEVICE for n in live)
        for s in range(3):
            t.step(s)  # --sync.verify: parity after every step
    finally:
        t.shutdown()


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_on_one_gpu_matches_the_torch_learner(report, stage):
    """World size 1, NCCL, torch's AdamW: one update equals the torch learner's."""
    from rlhf_plugins.algorithms import policy_losses
    from rlhf_plugins.algorithms.objective import Objective
    from rlhf_plugins.learners.deepspeed_learner import DeepSpeedLearner
    from rlhf_plugins.learners.torch_learner import TorchLearner
    from rlhf_plugins.models.tiny_model import default_model_path
    from rlhf_plugins.testing import backend_context

    lr, path = 1e-5, default_model_path()
    g = torch.Generator().manual_seed(1)
    batch = random_batch(group=4, prompts=4, seed=5)
    batch["advantages"] = torch.randn(batch["action_mask"].shape, generator=g) * batch["action_mask"]
    base = {"learner": {"lr": lr}, "train": {"prompts_per_step": 4}, "generation": {"n_samples_per_prompt": 4}}
    torch_cfg, pm, _ = prepare(base, autoload=False)
    local = TorchLearner(backend_context(torch_cfg, "actor", path, pm))
    before = {k: v.clone() for k, v in local.named_weights()}
    objective = Objective(policy_losses.ppo, torch_cfg.algo.policy_loss)
    expected = local.train(batch, objective)
    after_local = dict(local.named_weights())
    ds_cfg, pm, _ = prepare({**base, "learner": {"backend": "deepspeed", "lr": lr}, "deepspeed": {"zero_stage": stage}},
                            autoload=False)
    ds = DeepSpeedLearner(backend_context(ds_cfg, "actor", path, pm))
    try:
        import torch.distributed as dist

        assert dist.get_backend() == ("nccl" if DEVICE == "cuda" else "gloo") and ds.device.type == DEVICE
        got = ds.train(batch, objective)
        after_ds = {k: v.to(DEVICE) for k, v in ds.named_weights()}
    finally:
        ds.shutdown()
    worst = max(float((after_ds[k].float() - after_local[k].float()).abs().max()) for k in before)
    report(f"zero{stage}_vs_torch_max_weight_diff", worst)
    assert got["loss/policy"] == pytest.approx(expected["loss/policy"], abs=1e-5)
    assert worst < 0.05 * lr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fsdp_on_one_gpu_loads_its_shards_and_matches_the_torch_learner(report, dtype):
    """FSDP2 over one rank (NCCL): built empty and filled from the checkpoint's files on the GPU, the
    same weights as the torch learner's, and one update equal to it (float32; bf16 compute within
    bf16's rounding); the frozen reference on the same learner gives its log-probs."""
    from rlhf_plugins.algorithms import policy_losses
    from rlhf_plugins.algorithms.objective import Objective
    from rlhf_plugins.learners.fsdp_learner import FSDPLearner
    from rlhf_plugins.learners.torch_learner import TorchLearner
    from rlhf_plugins.models.tiny_model import default_model_path
    from rlhf_plugins.testing import backend_context

    lr, path = 1e-5, default_model_path()
    g = torch.Generator().manual_seed(1)
    batch = random_batch(group=4, prompts=4, seed=5)
    batch["advantages"] = torch.randn(batch["action_mask"].shape, generator=g) * batch["action_mask"]
    base = {"learner": {"lr": lr}, "train": {"prompts_per_step": 4}, "generation": {"n_samples_per_prompt": 4},
            "model": {"dtype": dtype}}
    torch_cfg, pm, _ = prepare(base, autoload=False)
    local = TorchLearner(backend_context(torch_cfg, "actor", path, pm))
    before = {k: v.clone() for k, v in local.named_weights()}
    initial = local.logprobs(batch)
    objective = Objective(policy_losses.ppo, torch_cfg.algo.policy_loss)
    expected = local.train(batch, objective)
    after_local = dict(local.named_weights())
    cfg, pm, _ = prepare({**base, "learner": {"backend": "fsdp", "lr": lr}}, autoload=False)
    fsdp = FSDPLearner(backend_context(cfg, "actor", path, pm))
    reference = FSDPLearner(backend_context(cfg, "reference", path, pm))
    import torch.distributed as dist

    assert dist.get_backend() == ("nccl" if DEVICE == "cuda" else "gloo") and fsdp.device.type == DEVICE
    assert fsdp.shard_bytes_read == 4 * sum(v.numel() for v in before.values())  # read from the files, all of it
    loaded = {k: v.to(DEVICE) for k, v in fsdp.named_weights()}
    assert all(torch.equal(loaded[k].float(), before[k].to(DEVICE).float()) for k in before)
    ref_gap = float((reference.logprobs(batch) - initial).abs().max())
    got = fsdp.train(batch, objective)
    after = {k: v.to(DEVICE) for k, v in fsdp.named_weights()}
    worst = max(float((after[k].float() - after_local[k].to(DEVICE).float()).abs().max()) for k in before)
    report(f"fsdp_{dtype}_vs_torch_max_weight_diff", worst)
    report(f"fsdp_{dtype}_reference_logprob_gap", ref_gap)
    exact = dtype == "float32"  # in bf16 the torch learner updates bf16 weights, FSDP float32 shards
    assert got["loss/policy"] == pytest.approx(expected["loss/policy"], abs=1e-5 if exact else 0.05)
    assert worst < (0.05 * lr if exact else 1e-3) and ref_gap < (1e-4 if exact else 0.1)


@pytest.mark.parametrize("logits_mb", [WHOLE_LOGITS, TINY_CHUNKS], ids=["whole-logits", "chunked-head"])
def test_the_compiled_learner_trains_as_the_eager_one_on_cuda(report, logits_mb):
    """--learner.compile on the GPU (Triton kernels for the norms and MLPs, and with a logits budget of
    4 tokens per chunk for the head's log-softmax and gradient), bf16 weights with float32 masters: over
    two updates at least as close to the float32 learner as the eager bf16 learner is (log-probs,
    gradient norms, weights). Float32 equality is checked on CPUs (tests/test_compile.py)."""
    from rlhf_plugins.models.compiled import compiled_blocks

    assert len(compiled_blocks(torch_learner("bfloat16", compile=True).model)) == 7
    gaps = compiled_learner_gaps("bfloat16", logits_memory_mb=logits_mb)
    report(f"compiled_bf16_gaps_to_float32_{'chunked_head' if logits_mb == TINY_CHUNKS else 'whole_logits'}", gaps)
    for key, eager in gaps["eager"].items():
        assert gaps["compiled"][key] <= 1.5 * eager, (key, gaps)


def test_whole_decoder_layers_compiled_train_as_the_eager_learner_on_cuda(report):
    """--learner.compile_scope layers on the GPU (Triton kernels for each whole decoder layer, the
    shared-prompt forward's cache updated between its two graphs): in float32 two updates equal the
    eager learner's (CUDA float32 matrix products, no TF32), as on CPUs (tests/test_compile.py)."""
    from rlhf_plugins.models.compiled import compiled_blocks

    model = torch_learner("float32", compile=True, compile_scope="layers").model
    assert compiled_blocks(model) == ["model.layers.0", "model.layers.1", "model.norm"]
    gaps = compiled_learner_gaps("float32", compile_scope="layers")
    report("compiled_layers_float32_gaps_to_eager", gaps["compiled"])
    assert max(gaps["compiled"].values()) < 1e-4, gaps


def test_16_bit_gradients_moved_by_buckets_equal_per_parameter_moves_on_cuda(monkeypatch):
    """bf16 weights with float32 masters on the GPU: gradients moved onto the masters a bucket at a time
    (one concatenation and one add each) give the masters, after one update of two micro batches, the
    values that moving each gradient as it completes gives, bit for bit (tests/test_master_weights.py
    counts the adds on a CPU; CUDA's backward runs on a thread of its own)."""
    bucketed, single = bucketed_and_per_parameter_learners(monkeypatch)
    assert 1 < len(bucketed.masters.buckets) < len(single.masters.buckets)
    assert bucketed.masters.grad.device.type == DEVICE
    got, want = ppo_update(bucketed, ppo_batch()), ppo_update(single, ppo_batch())
    assert got == want and got["grad_norm"] > 0
    assert all(torch.equal(a, b) for a, b in zip(bucketed.masters.masters, single.masters.masters))


@pytest.mark.parametrize("way", ["checkpointed", "packed"])
def test_shared_prompts_give_every_samples_own_logprobs_and_gradients_on_cuda(report, way):
    """Each prompt once for its group on the GPU -- under activation checkpointing (the prompt's cache
    written once, read by the completions, each layer recomputed) and in a packed row (each
    completion's attention reading its prompt's segment through SDPA's bottom-right causal mask) --
    against every sample run whole and padded, float32."""
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.models.device import to_device
    from rlhf_plugins.models.forward import policy_forward
    from rlhf_plugins.models.packing import sharing_group, token_budget_split
    from rlhf_plugins.models.tiny_model import default_model_path

    batch = to_device(random_batch(group=4, prompts=3, seed=3), torch.device(DEVICE))
    mask = batch["action_mask"].bool()

    def run(parts, checkpointed):
        model = AutoModelForCausalLM.from_pretrained(default_model_path()).to(DEVICE).train()
        if checkpointed:
            from rlhf_plugins.models.hf_names import enable_checkpointing

            enable_checkpointing(model)
        logprobs = torch.zeros(mask.shape, device=DEVICE)
        for part in parts(model):
            out = policy_forward(model, part)["logprobs"]
            (out * part["action_mask"]).sum().backward()
            logprobs[part.get("rows", slice(None))] = out.detach()
        return logprobs, {n: p.grad for n, p in model.named_parameters()}

    whole, whole_grads = run(lambda m: [dict(batch, group_size=1)], False)
    if way == "checkpointed":
        shared, grads = run(lambda m: [batch], True)
    else:
        shared, grads = run(lambda m: token_budget_split(batch, 10_000, sharing_group(m, batch)), False)
    gap = float((shared - whole).abs()[mask].max())
    grad_gap = max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in whole_grads.items())
    report(f"shared_prompts_{way}_gaps", {"logprobs": gap, "gradients_relative": grad_gap})
    assert gap < 1e-4 and grad_gap < 1e-3, (gap, grad_gap)


def test_lora_trains_on_cuda_and_saves_the_adapter(tmp_path):
    from rlhf_plugins.cli import main

    os.chdir(tmp_path)
    code = main(["train", "--lora.rank", "8", "--learner.lr", "5e-3", "--train.steps", "3", "--train.prompts_per_step",
                 "4", "--eval.enabled", "false", "--train.progress", "false", "--train.run_name", "lora"])
    assert code == 0
    assert (tmp_path / "runs" / "lora" / "final" / "adapter_config.json").is_file()
    rows = [json.loads(line) for line in (tmp_path / "runs" / "lora" / "metrics.jsonl").read_text().splitlines()]
    assert all(r.get("memory/actor_gpu_gb", 0) > 0 or DEVICE == "cpu" for r in rows if "reward/mean" in r)


def test_checkpoint_and_resume_on_cuda_give_the_same_steps(tmp_path):
    raw = {"train": {"prompts_per_step": 4}, "eval": {"enabled": False}}
    whole = run_steps(trainer(raw), 4)
    first = trainer(raw)
    first.setup()
    try:
        for s in range(2):
            first.step(s)
        folder = first.save_checkpoint(tmp_path / "run", keep=1)
    finally:
        first.shutdown()
    second = trainer(raw)
    second.setup()
    try:
        assert second.load_checkpoint(folder) == 2
        resumed = [second.step(s) for s in range(2, 4)]
    finally:
        second.shutdown()
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(MEASURED)}  # noqa: E731
    for a, b in zip(whole[2:], resumed):
        assert strip(a).keys() == strip(b).keys()
        for k in strip(a):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), k  # GPU kernels: not bit-exact


def test_a_qwen_0_5b_shape_runs_and_its_gpu_peak_is_near_its_analytic_need(tmp_path, report):
    from rlhf_plugins.models.memory import GIB
    from rlhf_plugins.models.shapes import build
    from rlhf_plugins.training.memory_plan import memory_plan

    path = str(build("qwen2.5-0.5b", tmp_path / "qwen"))
    raw = {"model": {"dtype": "bfloat16"}, "train": {"prompts_per_step": 8, "steps": 3},
           "generation": {"n_samples_per_prompt": 8, "max_new_tokens": 128}, "data": {"max_prompt_tokens": 64},
           "eval": {"enabled": False}}
    t = trainer(raw, path)
    plan = memory_plan(t.config, t.plan, 64)
    t.setup()
    phases: dict[str, float] = {}  # each role's phase: its peak GPU memory (every role kept, its working set)
    if DEVICE == "cuda":
        for role, handle, method in (("generation", t.engine, "generate"), ("reference", t.reference, "logprobs"),
                                     ("actor", t.actor, "train")):
            if handle is not None:
                setattr(handle, method, _phase_peak(phases, role, getattr(handle, method)))
    try:
        rows = [t.step(s) for s in range(3)]
    finally:
        t.shutdown()
    peak = max([r["memory/actor_gpu_gb" if DEVICE == "cuda" else "memory/actor_rss_gb"] for r in rows]
               + list(phases.values()))
    process = plan.processes[0]
    analytic = process.analytic / GIB
    report("qwen0.5b_gpu_peak_gb", peak)
    report("qwen0.5b_analytic_gb", analytic)
    report("qwen0.5b_seconds_per_step", [round(r["time/step"], 2) for r in rows])
    assert peak <= 1.3 * analytic + 0.5, (peak, analytic)
    kept = sum(n.total - n.working_set for n in process.needs) / GIB
    for need in process.needs:
        if need.role in phases:
            role_analytic = kept + need.working_set / GIB
            report(f"qwen0.5b_{need.role}_phase_gpu_peak_vs_analytic_gb", [round(phases[need.role], 2),
                                                                           round(role_analytic, 2)])
            assert phases[need.role] <= 1.3 * role_analytic + 0.5, (need.role, phases[need.role], role_analytic)


def _phase_peak(phases: dict[str, float], role: str, fn):
    """``fn`` with the GPU's peak memory of each call recorded under ``role`` (the largest call)."""
    from rlhf_plugins.models.memory import GIB

    def call(*args, **kwargs):
        torch.cuda.reset_peak_memory_stats()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[role] = max(phases.get(role, 0.0), torch.cuda.max_memory_allocated() / GIB)
    return call


def test_decode_steps_replayed_as_a_cuda_graph_sample_what_eager_steps_sample(report, monkeypatch):
    """The transformers engine on the GPU, float32: decode steps captured once per call and replayed
    as a CUDA graph give the tokens and log-probs of eager steps over the growing cache (ragged
    prompts, shared and per-sample prefixes, early stops); the capture happened; ms per token of each."""
    import time

    from rlhf_plugins import SamplingParams
    from rlhf_plugins.engines import static_decode
    from rlhf_plugins.engines.transformers_engine import TransformersEngine
    from rlhf_plugins.models.tiny_model import default_model_path
    from rlhf_plugins.testing import backend_context

    captured = []
    capture = static_decode.StaticDecode._capture
    monkeypatch.setattr(static_decode.StaticDecode, "_capture", lambda self: captured.append(capture(self)) or captured[-1])
    config, pm, _ = prepare({}, autoload=False)
    engine = TransformersEngine(backend_context(config, "generation", default_model_path(), pm))
    assert engine.device.type == DEVICE and engine.cuda_graphs == (DEVICE == "cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, engine.model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 17, 33)]
    cases = ((4, 40), (4, 3), (1, 12))
    runs, ms = {}, {}
    for graphs in (True, False):
        engine.cuda_graphs = engine.fixed_shapes = graphs and DEVICE == "cuda"
        start = time.perf_counter()
        runs[graphs] = [engine.generate(prompts, SamplingParams(n=n, max_new_tokens=b, temperature=1.3, seed=11))
                        for n, b in cases]
        tokens = sum(max(map(len, r.completion_ids)) for r in runs[graphs])
        ms[graphs] = 1000 * (time.perf_counter() - start) / tokens
    report("decode_ms_per_token_graph_vs_eager", [round(ms[True], 3), round(ms[False], 3)])
    assert len(captured) == (3 if DEVICE == "cuda" else 0) and all(c is not None for c in captured)
    for a, b in zip(runs[True], runs[False]):
        assert_same_samples(a, b, atol=1e-4)


# the CUDA-graph tests last: the longest (each compiles its layers twice), so that a device check cut
# short by its cap has run every other test first
def test_decoder_layers_replayed_as_cuda_graphs_train_as_the_eager_learner(report):
    """--learner.compile_mode reduce-overhead with whole layers compiled: each layer's compiled parts
    in the training forward and backward replay CUDA graphs (inductor skipped none, the graph tree
    recorded some) and, in float32, two updates on batches of other shapes equal the eager learner's;
    the no-gradient passes (old log-probs) run the same compiled code without graphs."""
    from torch._dynamo.utils import counters

    gaps = compiled_learner_gaps("float32", compile_scope="layers", compile_mode="reduce-overhead")
    report("cuda_graph_layers_float32_gaps_to_eager", gaps["compiled"])
    assert max(gaps["compiled"].values()) < 1e-4, gaps
    _assert_graphs_replayed(counters)


def test_bf16_decoder_layers_replayed_as_cuda_graphs_update_as_without_graphs(report):
    """The bench's ``ours-graphs-layers-16384`` setting -- bf16 weights with float32 masters, whole
    compiled layers: with CUDA graphs, two updates of two micro batches each equal the same compiled
    layers' without graphs (the graphs replay their very kernels, and each 16-bit gradient, a tensor
    of the graphs' pool, reaches its master before the next micro batch's graphs run)."""
    from torch._dynamo.utils import counters

    counters.clear()
    gaps = cuda_graph_gaps("bfloat16")
    report("cuda_graph_layers_bf16_gaps_to_no_graphs", gaps)
    assert gaps["logprobs"] < 1e-2 and gaps["grad_norm"] < 1e-2 and gaps["weights"] < 1e-3, gaps
    _assert_graphs_replayed(counters)


def _assert_graphs_replayed(counters) -> None:
    """On a GPU: inductor skipped no CUDA graph, and the graph tree recorded some."""
    if DEVICE == "cuda":
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        assert manager is not None and sum(map(len, manager.roots.values())) >= 1
