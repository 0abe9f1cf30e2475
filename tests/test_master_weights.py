"""16-bit working weights with float32 master copies (rlhf_plugins.learners.master_weights): the update
against AdamW on float32 copies written out here, float32 accumulation over micro batches, the learner
computing as the engine does, the engine sharing its parameters, and checkpoints that resume exactly."""
from __future__ import annotations

import pytest
import torch

from rlhf_plugins.learners.master_weights import MasterWeights
from tests.helpers import (
    before_each_optimizer_step,
    bucketed_and_per_parameter_learners,
    largest_allocation,
    ppo_batch,
    ppo_update,
    random_batch,
    torch_learner,
)


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(torch.bfloat16)


def test_micro_batches_accumulate_in_float32_and_the_update_is_adamw_on_the_masters():
    model, twin = mlp(0), mlp(0)
    masters = MasterWeights(model)
    opt = torch.optim.AdamW(masters.masters, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 16, generator=g, dtype=torch.bfloat16) for _ in range(3)]
    for x in xs:
        model(x).float().square().mean().backward()
        assert all(p.grad is None for p in model.parameters())  # each 16-bit gradient moved as it completed
    # written out: each micro batch's 16-bit gradients, added in float32; AdamW on float32 copies
    want = [torch.zeros_like(p, dtype=torch.float32) for p in twin.parameters()]
    for x in xs:
        for acc, grad in zip(want, torch.autograd.grad(twin(x).float().square().mean(), list(twin.parameters()))):
            acc += grad.float()
    for master, expected in zip(masters.masters, want):
        assert torch.equal(master.grad, expected)
    in_bf16 = [sum(torch.autograd.grad(twin(x).float().square().mean(), [p])[0] for x in xs) for p in twin.parameters()]
    assert any(not torch.equal(a.float(), b) for a, b in zip(in_bf16, want))  # what 16-bit accumulation would lose
    copies = [torch.nn.Parameter(p.detach().float()) for p in twin.parameters()]
    for c, grad in zip(copies, want):
        c.grad = grad.clone()
    torch.optim.AdamW(copies, lr=1e-2).step()
    opt.step()
    masters.write_back()
    for p, master, c in zip(model.parameters(), masters.masters, copies):
        assert torch.equal(master, c) and p.dtype == torch.bfloat16 and torch.equal(p, c.to(torch.bfloat16))


def test_the_learner_trains_16_bit_weights_and_computes_as_the_engine_does():
    """bf16 weights in the model (no autocast), float32 masters in the optimizer, the weights equal to
    the masters after an update; the learner's log-probs are those of a plain bf16 forward (the
    engine's numerics), which the autocast learner's are not."""
    from rlhf_plugins.models.forward import policy_forward

    lr = torch_learner()
    assert lr.autocast_dtype is None and all(p.dtype == torch.bfloat16 for p in lr.model.parameters())
    opt = [p for group in lr.optimizer.param_groups for p in group["params"]]
    assert opt and all(p.dtype == torch.float32 for p in opt)
    metrics = ppo_update(lr, ppo_batch())
    assert metrics["grad_norm"] > 0
    for (_, p), master in zip(lr.masters.named, lr.masters.masters):
        assert torch.equal(p, master.to(torch.bfloat16))
    assert any(not torch.equal(master, master.to(torch.bfloat16).float()) for master in lr.masters.masters)
    batch = random_batch(group=4, prompts=3, seed=7)
    plain = policy_forward(lr.model.eval(), batch, logits_memory_mb=0)["logprobs"].float().detach()
    assert torch.equal(lr.logprobs(batch), plain)
    autocast = torch_learner(master_weights=False)
    assert autocast.autocast_dtype is torch.bfloat16 and next(autocast.model.parameters()).dtype == torch.float32
    assert not torch.equal(autocast.logprobs(batch), torch_learner().logprobs(batch))


def test_a_checkpoint_holds_the_float32_masters_and_resumes_exactly(tmp_path):
    from safetensors import safe_open

    first = torch_learner()
    ppo_update(first, ppo_batch(1))
    first.save_checkpoint(str(tmp_path / "ckpt"))
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    names = dict(first.masters.named)
    assert all(saved[n].dtype == torch.float32 for n in names if n in saved)
    resumed = torch_learner()
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    for a, b in zip(first.masters.masters, resumed.masters.masters):
        assert torch.equal(a, b)
    assert all(torch.equal(p, q) for p, q in zip(first.model.parameters(), resumed.model.parameters()))
    assert ppo_update(first, ppo_batch(2)) == ppo_update(resumed, ppo_batch(2))
    assert all(torch.equal(a, b) for a, b in zip(first.masters.masters, resumed.masters.masters))


def test_a_float16_run_scales_its_loss_and_unscales_the_masters_gradients():
    """float16: the gradient scaler skips the updates whose scaled 16-bit gradients overflowed (lowering
    its scale) and applies the first that did not, with the masters' gradients unscaled."""
    lr = torch_learner("float16")
    assert lr.scaler is not None and lr.masters is not None
    assert all(p.dtype == torch.float16 for p in lr.model.parameters())
    before = [m.detach().clone() for m in lr.masters.masters]
    norms = []
    while len(norms) < 30 and not (norms and 0 < norms[-1] < float("inf")):
        norms.append(ppo_update(lr, ppo_batch())["grad_norm"])
        if not 0 < norms[-1] < float("inf"):  # skipped: nothing moved
            assert all(torch.equal(a, b) for a, b in zip(before, lr.masters.masters))
    assert 0 < norms[-1] < 1e3 and lr.scaler.get_scale() < 2.0 ** 16, norms
    assert any(not torch.equal(a, b) for a, b in zip(before, lr.masters.masters))
    assert all(torch.equal(p, m.to(torch.float16)) for (_, p), m in zip(lr.masters.named, lr.masters.masters))


@pytest.mark.parametrize("master_weights", [True, False])
def test_the_plan_counts_16_bit_weights_beside_float32_masters(master_weights):
    from rlhf_plugins.api import prepare
    from rlhf_plugins.models.memory import MemoryInputs, ModelShape, torch_learner_memory
    from rlhf_plugins.models.shapes import shape_config

    config, _, _ = prepare({"model": {"dtype": "bfloat16"}, "learner": {"master_weights": master_weights}},
                           autoload=False)
    shape = ModelShape.from_config(shape_config("qwen2.5-0.5b"))
    P = shape.parameters
    parts = torch_learner_memory(MemoryInputs(config, shape, "actor", ranks=1, trainable=P, micro_tokens=0,
                                              logits_bytes=0))
    if master_weights:
        assert parts["weights"] == 2 * P and parts["fp32 master weights"] == 4 * P
    else:
        assert parts["weights"] == 4 * P and "fp32 master weights" not in parts
    assert parts["gradients"] == 4 * P and parts["optimizer states"] == 8 * P


def test_a_bf16_synchronous_run_shares_the_learners_16_bit_weights_with_the_engine():
    """The engine samples with the learner's own bf16 tensors (no copy at set-up or after an update),
    as a float32 run does; the plan counts the weights once."""
    from transformers import AutoTokenizer

    from rlhf_plugins.api import prepare
    from rlhf_plugins.data.prompts import load_prompts
    from rlhf_plugins.models.tiny_model import default_model_path
    from rlhf_plugins.training.loop import Trainer
    from rlhf_plugins.training.memory_plan import shares_weights

    path = default_model_path()
    config, pm, plan = prepare({"model": {"dtype": "bfloat16"}, "train": {"steps": 1, "prompts_per_step": 4}},
                               autoload=False)
    assert shares_weights(config, plan)
    tokenizer = AutoTokenizer.from_pretrained(path)
    t = Trainer(config, pm, plan, load_prompts(config.data, tokenizer), tokenizer, path)
    t.setup()
    try:
        live = dict(t.actor.live_weights())
        engine = dict(t.engine.engine.model.named_parameters())
        assert live.keys() == engine.keys() and all(v.dtype == torch.bfloat16 for v in live.values())
        assert all(live[n].data_ptr() == engine[n].data_ptr() for n in live)
        before = {n: v.clone() for n, v in live.items()}
        t.step(0)
        assert t.sync.shared and all(live[n].data_ptr() == p.data_ptr() for n, p in t.actor.live_weights())
        assert any(not torch.equal(before[n], engine[n]) for n in live)  # the update reached the engine
    finally:
        t.shutdown()


def _head_gradient_at_step(lr) -> list[torch.Tensor]:
    """Records the output head's float32 master gradient each time the optimizer steps."""
    head = lr.model.get_output_embeddings().weight
    master = next(m for (_, p), m in zip(lr.masters.named, lr.masters.masters) if p is head)
    seen: list[torch.Tensor] = []
    before_each_optimizer_step(lr.optimizer, lambda: seen.append(master.grad.clone()))
    return seen


def test_the_fused_head_adds_into_the_masters_and_the_update_matches_the_unfused_path(monkeypatch):
    """Chunked log-probs (a one-token budget) through the fused head, whose weight gradient goes into
    the head's float32 master directly, against the autograd + checkpoint path (16-bit gradients moved
    onto the master): the same head gradient and gradient norm within bf16's rounding."""
    from rlhf_plugins.models import logits

    fused = torch_learner(logits_memory_mb=0.001)
    plain = torch_learner(logits_memory_mb=0.001)
    got_head, want_head = _head_gradient_at_step(fused), _head_gradient_at_step(plain)
    got = ppo_update(fused, ppo_batch())
    monkeypatch.setattr(logits, "fusable", lambda head: False)
    want = ppo_update(plain, ppo_batch())
    assert len(got_head) == len(want_head) == 1 and want_head[0].norm() > 0
    assert float((got_head[0] - want_head[0]).norm() / want_head[0].norm()) < 0.02
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.02)
    assert got["loss/policy"] == pytest.approx(want["loss/policy"], rel=1e-3, abs=1e-4)


def test_the_optimizer_step_is_torchs_fused_adamw_with_no_temporary_the_size_of_a_parameter():
    """torch's per-tensor AdamW allocates float32 temporaries the size of each parameter (0.8 GB more at
    the peak for the 0.5B shape's embedding); the fused one updates in place."""
    import torch

    lr = torch_learner("float32")
    assert lr.optimizer.defaults.get("fused") is True
    params = [p for group in lr.optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.randn_like(p)
    lr.optimizer.step()  # the first step allocates the states
    largest = largest_allocation(lr.optimizer.step)
    assert largest < max(p.nbytes for p in params) / 4, largest


def _master_adds(lr, batch) -> tuple[int, list[torch.Tensor], dict[str, float]]:
    """One update of ``lr``: how many adds landed in the masters' gradient buffer, the masters'
    gradients the optimizer stepped on, and the metrics."""
    from torch.utils._python_dispatch import TorchDispatchMode

    buffer = lr.masters.grad.untyped_storage().data_ptr()
    adds, seen = [], []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.add_.Tensor and args[0].untyped_storage().data_ptr() == buffer:
                adds.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    before_each_optimizer_step(lr.optimizer, lambda: seen.extend(m.grad.clone() for m in lr.masters.masters))
    with Count():
        metrics = ppo_update(lr, ppo_batch())
    return len(adds), seen, metrics


def test_buckets_move_the_16_bit_gradients_bit_for_bit_as_per_parameter_moves_in_one_add_each(monkeypatch):
    """Two micro batches: the masters' gradients, the update and its metrics equal those of moving each
    gradient as it completes, with one add per bucket instead of one per parameter."""
    bucketed, single = bucketed_and_per_parameter_learners(monkeypatch)
    params, buckets = len(bucketed.masters.named), len(bucketed.masters.buckets)
    assert 1 < buckets < params / 2 and len(single.masters.buckets) == params
    assert sorted(i for span in bucketed.masters.buckets for i in span) == list(range(params))
    got_adds, got, got_metrics = _master_adds(bucketed, ppo_batch())
    want_adds, want, want_metrics = _master_adds(single, ppo_batch())
    assert (got_adds, want_adds) == (2 * buckets, 2 * params)  # two micro batches
    assert len(got) == len(want) == params and any(w.abs().sum() > 0 for w in want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got_metrics == want_metrics
    assert all(torch.equal(a, b) for a, b in zip(bucketed.masters.masters, single.masters.masters))
    assert not bucketed.masters._waiting and all(p.grad is None for p in bucketed.model.parameters())


def test_a_bucket_with_a_parameter_autograd_gave_nothing_moves_as_the_backward_ends():
    """A parameter the forward does not use gets no gradient: its bucket's others still reach their
    masters when the backward ends (one bucket here), its own master's gradient stays zero."""
    torch.manual_seed(0)
    unused = torch.nn.Linear(4, 4)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(16, 8), "unused": unused, "b": torch.nn.Linear(8, 2)})
    model = model.to(torch.bfloat16)
    masters = MasterWeights(model)
    assert len(masters.buckets) == 1
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    model["b"](torch.tanh(model["a"](x))).float().square().mean().backward()
    assert not masters._waiting
    names = [name for name, _ in masters.named]
    grads = dict(zip(names, (m.grad for m in masters.masters)))
    assert torch.count_nonzero(grads["unused.weight"]) == 0 and torch.count_nonzero(grads["unused.bias"]) == 0
    twin = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    twin[0].load_state_dict(model["a"].state_dict())
    twin[2].load_state_dict(model["b"].state_dict())
    want = torch.autograd.grad(twin(x).float().square().mean(), list(twin.parameters()))
    for name, w in zip(("a.weight", "a.bias", "b.weight", "b.bias"), want):
        assert torch.count_nonzero(w) > 0 and torch.equal(grads[name], w.float())


def test_a_second_gradient_in_one_backward_reaches_the_master_too():
    """Reentrant checkpointing runs a backward per segment: a weight used in two segments gets two
    gradients in one backward, and its master holds their float32 sum as with per-parameter moves (an
    unused layer keeps the one bucket open until the backward ends, so both arrive while it waits)."""
    from torch.utils.checkpoint import checkpoint

    def run(bucket_bytes: int) -> list[torch.Tensor]:
        torch.manual_seed(0)
        shared, head = torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.Linear(8, 1).to(torch.bfloat16)
        unused = torch.nn.Linear(2, 2).to(torch.bfloat16)
        masters = MasterWeights(torch.nn.ModuleList([shared, head, unused]), bucket_bytes)
        assert len(masters.buckets) == (1 if bucket_bytes else 6)
        x = torch.randn(6, 8, dtype=torch.bfloat16, requires_grad=True)
        h = checkpoint(lambda t: torch.tanh(shared(t)), x, use_reentrant=True)
        h = checkpoint(lambda t: torch.tanh(shared(t)), h, use_reentrant=True)
        head(h).float().square().mean().backward()
        assert not masters._waiting
        return [m.grad.clone() for m in masters.masters]

    got, want = run(2**20), run(0)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and all(torch.count_nonzero(w) > 0 for w in want[:4])


def test_gradients_waiting_for_parameters_that_got_none_are_held_to_a_bound():
    """Experts no token reached: every bucket holds a layer the forward skips, so none completes; the
    16-bit gradients waiting never exceed HELD_BUCKETS buckets' worth (the longest waiting move on), and
    every master gets what per-parameter moves give it."""
    import copy

    from rlhf_plugins.learners.master_weights import HELD_BUCKETS

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([torch.nn.Linear(32, 32, bias=False) for _ in range(24)]).to(torch.bfloat16)
    twin = copy.deepcopy(layers)
    bucket = 2 * 32 * 32 * 2  # two layers' 16-bit gradients: each bucket one layer used, one skipped
    masters, single = MasterWeights(layers, bucket), MasterWeights(twin, 0)
    held = []
    for p in layers.parameters():  # after the masters' own hook: what waits once each gradient is in
        p.register_post_accumulate_grad_hook(lambda _: held.append(masters.held))
    x = torch.randn(4, 32, dtype=torch.bfloat16)

    def loss(modules):
        h = x
        for m in list(modules)[::2]:
            h = torch.tanh(m(h))
        return h.float().square().mean()

    loss(layers).backward()
    loss(twin).backward()
    assert len(held) == 12 and 0 < max(held) <= HELD_BUCKETS * bucket < 12 * 32 * 32 * 2
    assert not masters._waiting and masters.held == 0
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(masters.masters, single.masters))
    assert sum(int(torch.count_nonzero(m.grad) > 0) for m in masters.masters) == 12


def test_lora_adapters_in_a_bf16_model_are_their_own_float32_masters():
    """PEFT makes a 16-bit model's adapters in float32: the optimizer steps them directly (no master copies,
    nothing to write back), the 16-bit base stays as loaded, and an update moves every adapter."""
    from rlhf_plugins.api import prepare
    from rlhf_plugins.learners.torch_learner import TorchLearner
    from rlhf_plugins.models.tiny_model import default_model_path
    from rlhf_plugins.testing import backend_context

    raw = {"model": {"dtype": "bfloat16"}, "lora": {"rank": 4}, "learner": {"lr": 1e-3, "micro_batch_size": 6},
           "train": {"prompts_per_step": 3}, "generation": {"n_samples_per_prompt": 4}}
    config, pm, _ = prepare(raw, autoload=False)
    lr = TorchLearner(backend_context(config, "actor", default_model_path(), pm))
    adapters = [p for n, p in lr.model.named_parameters() if p.requires_grad]
    assert adapters and all(p.dtype == torch.float32 for p in adapters) and lr.masters.named == []
    stepped = [p for group in lr.optimizer.param_groups for p in group["params"]]
    assert len(stepped) == len(adapters) and all(a is b for a, b in zip(stepped, adapters))
    base = {n: p.detach().clone() for n, p in lr.model.named_parameters() if not p.requires_grad}
    assert base and all(p.dtype == torch.bfloat16 for p in base.values())
    before = [p.detach().clone() for p in adapters]
    assert ppo_update(lr, ppo_batch())["grad_norm"] > 0
    assert all(torch.equal(p, base[n]) for n, p in lr.model.named_parameters() if n in base)
    # each B (zero at the start) moves; each A's gradient is zero while its B is
    assert sum(not torch.equal(a, b) for a, b in zip(adapters, before)) == len(adapters) // 2
