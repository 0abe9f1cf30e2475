"""The output head, log-softmax and gather as one autograd function (rlhf_plugins.models.fused_head):
its values and gradients against independent float64 formulas on random inputs, under autocast, and
the work it saves against the autograd + checkpoint path it replaces."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf_plugins.models import logits as logits_mod
from rlhf_plugins.models.fused_head import COMPILED, FusedHeadStats, fusable, head_stats

VOCAB, HIDDEN = 5003, 24


def reference(weight, bias, hidden, tokens, temperature, softcap=None):
    """log softmax and entropy written from their definitions, in float64 (the logits soft-capped,
    ``c tanh(z / c)``, before the temperature when ``softcap`` is given)."""
    z = hidden.double() @ weight.double().t() + (bias.double() if bias is not None else 0)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp = z - z.exp().sum(-1, keepdim=True).log()
    picked = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked, -(logp.exp() * logp).sum(-1)


def make(seed, bias=True, dtype=torch.float64, n=37):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.3)
        if bias:
            head.bias.copy_(torch.randn(VOCAB, generator=g))
    hidden = torch.randn(n, HIDDEN, generator=g, dtype=dtype).requires_grad_()
    tokens = torch.randint(0, VOCAB, (n,), generator=g)
    weights = torch.randn(2, n, generator=g, dtype=torch.float64)
    return head, hidden, tokens, weights


def made_by_fused(t: torch.Tensor) -> bool:
    """Whether the fused function is in the graph that computed ``t``."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == f"{FusedHeadStats.__name__}Backward":
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors, retain_graph=True)


def assert_equals_the_formulas(head, hidden, tokens, w, temperature, with_entropy, softcap=None,
                               stats=head_stats):
    """``stats`` (``head_stats``) in chunks of 5 tokens (a ragged last one): log-probs and entropy equal
    :func:`reference`'s, and so do the gradients of a weighted sum of them for the hidden states, the
    weight and the bias. Returns what ``stats`` gave."""
    params = [hidden, head.weight] + ([head.bias] if head.bias is not None else [])
    got = stats(head, hidden, tokens, temperature, with_entropy, 5, softcap)
    want = reference(head.weight, head.bias, hidden, tokens, temperature, softcap)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    loss_got = (got[0] * w[0]).sum() + ((got[1] * w[1]).sum() if with_entropy else 0)
    loss_want = (want[0] * w[0]).sum() + ((want[1] * w[1]).sum() if with_entropy else 0)
    for a, b in zip(grads(loss_got, *params), grads(loss_want, *params)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    return got


@pytest.mark.parametrize("temperature,with_entropy,bias", [(1.0, True, True), (0.6, True, False), (1.3, False, True)])
def test_values_and_gradients_equal_the_formulas_in_float64(temperature, with_entropy, bias):
    head, hidden, tokens, w = make(0, bias=bias)
    got = assert_equals_the_formulas(head, hidden, tokens, w, temperature, with_entropy)
    assert made_by_fused(got[0])


@pytest.mark.parametrize("temperature,with_entropy,bias", [(0.6, True, False), (1.3, False, True)])
def test_compiled_chunks_equal_the_formulas_in_float64(temperature, with_entropy, bias):
    """--learner.compile's head: each chunk's statistics and gradient through torch.compile'd
    functions (dynamo made their graphs), the same values and gradients as the formulas."""
    from torch._dynamo.utils import counters

    from rlhf_plugins.models.compiled import cpu_compiler

    if cpu_compiler() is None:
        pytest.skip("torch.compile on a CPU needs a C++ compiler")
    head, hidden, tokens, w = make(4, bias=bias)
    setattr(head, COMPILED, True)
    torch._dynamo.reset()
    counters.clear()
    assert_equals_the_formulas(head, hidden, tokens, w, temperature, with_entropy)
    assert counters["stats"]["unique_graphs"] >= 2  # the statistics' graph and the gradient's


@pytest.mark.parametrize("path", ["fused", "compiled", "autograd"])
@pytest.mark.parametrize("temperature,with_entropy", [(1.0, True), (0.7, False)])
def test_soft_capped_logits_and_their_gradients_equal_the_formulas(path, temperature, with_entropy, monkeypatch):
    """Gemma 2's ``final_logit_softcapping``, ``c tanh(z / c)``, applied chunk by chunk -- by the fused
    head, its compiled chunks, and autograd through checkpointed chunks (a head that is not a plain
    linear layer) --: values and gradients equal the float64 formulas. A cap of 3 bends logits of
    this size, so the uncapped values are far off."""
    from rlhf_plugins.models.compiled import cpu_compiler

    if path == "compiled" and cpu_compiler() is None:
        pytest.skip("torch.compile on a CPU needs a C++ compiler")
    head, hidden, tokens, w = make(7)
    if path == "compiled":
        setattr(head, COMPILED, True)
    if path == "autograd":
        monkeypatch.setattr(logits_mod, "fusable", lambda h: False)
    got = assert_equals_the_formulas(head, hidden, tokens, w, temperature, with_entropy, softcap=3.0,
                                     stats=logits_mod.head_token_stats)
    assert made_by_fused(got[0]) == (path != "autograd")
    uncapped = reference(head.weight, head.bias, hidden, tokens, temperature)[0]
    assert (got[0] - uncapped).abs().max() > 0.5


def test_entropy_asked_for_but_unused_in_the_loss_and_log_probs_unused():
    """Either output may carry no gradient: the other's gradient is still exact."""
    head, hidden, tokens, w = make(1)
    lp, ent = head_stats(head, hidden, tokens, 1.0, True, chunk=7)
    want_lp, want_ent = reference(head.weight, head.bias, hidden, tokens, 1.0)
    for got, want in (((lp * w[0]).sum(), (want_lp * w[0]).sum()), ((ent * w[1]).sum(), (want_ent * w[1]).sum())):
        for a, b in zip(grads(got, hidden, head.weight), grads(want, hidden, head.weight)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_frozen_head_gives_only_the_hidden_states_gradient_and_no_grad_mode_saves_nothing():
    head, hidden, tokens, w = make(2)
    head.requires_grad_(False)
    lp, = head_stats(head, hidden, tokens, 1.0, False, chunk=4)
    (lp * w[0]).sum().backward()
    want, _ = reference(head.weight, head.bias, hidden.detach().requires_grad_(), tokens, 1.0)
    assert head.weight.grad is None and hidden.grad is not None
    with torch.inference_mode():
        out, = head_stats(head, hidden, tokens, 1.0, False, chunk=4)
    assert out.grad_fn is None
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_the_matmul_runs_in_16_bits_and_the_weight_gradient_stays_float32(dtype):
    """float32 weights under CPU autocast (the torch learner's mixed precision): the logits are the
    16-bit matmul's, as the model's own head gives them; gradients close to float64's (16-bit inputs)
    and returned in the parameters' float32."""
    head, hidden, tokens, w = make(3, dtype=torch.float32, n=64)
    with torch.autocast("cpu", dtype=dtype):
        at_one = head_stats(head, hidden, tokens, 1.0, True, chunk=16)
        own = logits_mod.token_stats(head(hidden), tokens, 1.0, True)
        lp, ent = head_stats(head, hidden, tokens, 0.8, True, chunk=16)
    for a, b in zip(at_one, own):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    got = grads((lp * w[0]).sum() + (ent * w[1]).sum(), hidden, head.weight, head.bias)
    assert all(g.dtype == torch.float32 for g in got)
    want_lp, want_ent = reference(head.weight, head.bias, hidden, tokens, 0.8)
    want = grads((want_lp * w[0]).sum() + (want_ent * w[1]).sum(), hidden, head.weight, head.bias)
    for a, b in zip(got, want):
        err = (a.double() - b).norm() / b.norm()
        assert err < (0.02 if dtype == torch.bfloat16 else 0.003), err


def test_what_is_not_a_plain_linear_head_is_not_fused():
    from peft import LoraConfig, get_peft_model

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(4, 8)

    assert fusable(torch.nn.Linear(4, 8))
    lora = get_peft_model(Model(), LoraConfig(r=2, target_modules=["lm_head"]))
    assert not fusable(lora.base_model.model.lm_head)
    with torch.device("meta"):
        assert not fusable(torch.nn.Linear(4, 8))
    partitioned = torch.nn.Linear(4, 8)
    partitioned.weight.ds_id = 0  # a ZeRO-3 partition: its module's forward gathers it
    assert not fusable(partitioned)


class VocabPasses(TorchDispatchMode):
    """Counts ops that produce a tensor with a vocabulary-sized dimension (a pass over the logits),
    and casts of the head's weight."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.logit_ops = 0
        self.weight_casts = 0
        self.rows = rows

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if torch.is_tensor(t) and t.dim() == 2 and t.shape == (self.rows, VOCAB):
                self.logit_ops += 1
            if torch.is_tensor(t) and t.shape == (VOCAB, HIDDEN) and func is torch.ops.aten._to_copy.default:
                self.weight_casts += 1
        return out


def _backward_work(fused: bool, chunk: int, monkeypatch) -> VocabPasses:
    head, hidden, tokens, w = make(4, dtype=torch.float32, n=8 * chunk)
    monkeypatch.setattr(logits_mod, "fusable", lambda h: fused)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = logits_mod.head_token_stats(head, hidden, tokens, 0.9, True, chunk)
    loss = (lp * w[0]).sum() + (ent * w[1]).sum()
    with VocabPasses(chunk) as seen:
        loss.backward()
    return seen


def test_the_backward_pass_makes_fewer_passes_over_the_logits_and_casts_the_weight_once(monkeypatch):
    """What the fused backward saves on a GPU, counted op by op: per chunk, passes over its logits
    (autograd through checkpoint: the recomputed forward, log-softmax's and gather's backward, the
    casts) and, under autocast, casts of the head's weight (once per chunk through autograd)."""
    chunk = 16
    fused = _backward_work(True, chunk, monkeypatch)
    autograd = _backward_work(False, chunk, monkeypatch)
    assert fused.weight_casts == 1 and autograd.weight_casts >= 8
    assert fused.logit_ops * 2 <= autograd.logit_ops, (fused.logit_ops, autograd.logit_ops)  # 13 vs 34 per chunk


def test_the_policy_forward_of_a_real_vocabulary_model_takes_the_fused_path():
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.models.forward import policy_forward
    from rlhf_plugins.models.shapes import shape_config
    from tests.helpers import random_batch

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(shape_config("qwen2.5-0.5b", layers=1, hidden=32))
    out = policy_forward(model, random_batch(seed=5), logits_memory_mb=1.0)
    assert made_by_fused(out["logprobs"])
    assert not made_by_fused(policy_forward(model, random_batch(seed=5), logits_memory_mb=0)["logprobs"])


def test_a_weight_with_a_float32_main_grad_gets_its_gradient_added_there_and_none_through_autograd():
    """A 16-bit weight beside a float32 master (learners/master_weights.py): the head's gradient is
    accumulated into ``main_grad`` in float32 (on top of what it holds), and autograd gets none."""
    head, hidden, tokens, w = make(5, dtype=torch.float64)
    want_lp, _ = reference(head.weight, head.bias, hidden, tokens, 1.0)
    want = grads((want_lp * w[0]).sum(), head.weight)[0]
    bf16 = torch.nn.Linear(HIDDEN, VOCAB, dtype=torch.bfloat16)
    with torch.no_grad():
        bf16.weight.copy_(head.weight)
        bf16.bias.copy_(head.bias)
    held = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(6))
    bf16.weight.main_grad = held.clone()
    lp, = head_stats(bf16, hidden.detach().to(torch.bfloat16), tokens, 1.0, False, chunk=6)
    (lp * w[0].float()).sum().backward()
    assert bf16.weight.grad is None and bf16.bias.grad is not None
    added = bf16.weight.main_grad - held
    assert bf16.weight.main_grad.dtype == torch.float32
    assert ((added.double() - want).norm() / want.norm()) < 0.02  # bf16 inputs; accumulated in float32
