"""Log-probs, entropy and their gradients over a real-size vocabulary, a chunk of tokens at a time:
equal to the unchunked computation (float64), and no tensor of logits larger than one chunk."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf_plugins.models.forward import policy_forward
from rlhf_plugins.models.logits import BYTES_PER_LOGIT, chunk_tokens, output_head
from tests.helpers import largest_allocation, random_batch

VOCAB = 151936


@pytest.fixture(scope="module")
def model():
    """A two-layer Qwen2 with Qwen2.5's vocabulary, tied embeddings and grouped-query attention, in float64."""
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.models.shapes import shape_config

    torch.manual_seed(0)
    config = shape_config("qwen2.5-0.5b", layers=2, hidden=64)
    assert config.vocab_size == VOCAB and config.tie_word_embeddings and config.num_key_value_heads == 1
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="sdpa")


class LargestVocabTensor(TorchDispatchMode):
    """Records the largest number of rows of any tensor an op produces whose last dimension is the
    vocabulary (the head's weight, transposed for its matmul, aside)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.rows = 0
        self.weight = (hidden, VOCAB)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if torch.is_tensor(t) and t.shape[-1:] == (VOCAB,) and tuple(t.shape) != self.weight:
                self.rows = max(self.rows, t.numel() // VOCAB)
        return out


def _grads(model, batch, budget, temperature, weights):
    model.zero_grad()
    out = policy_forward(model, batch, temperature, with_entropy=True, logits_memory_mb=budget)
    mask = batch["action_mask"]
    ((out["logprobs"] * weights[0] + out["entropy"] * weights[1]) * mask).sum().backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("temperature,shared", [(1.0, True), (0.7, False)])
def test_chunked_logprobs_entropy_and_gradients_equal_the_unchunked_ones(model, temperature, shared):
    batch = random_batch(group=4, prompts=3, seed=1)
    if not shared:
        batch = dict(batch, group_size=1)
    n_tokens = batch["action_mask"].numel()
    budget = 2 * VOCAB * BYTES_PER_LOGIT / 2**20  # two tokens per chunk: many chunks, a ragged last one
    assert chunk_tokens(VOCAB, budget) == 2 < n_tokens
    g = torch.Generator().manual_seed(2)
    weights = torch.randn(2, *batch["action_mask"].shape, generator=g, dtype=torch.float64)
    whole, whole_grads = _grads(model, batch, 0, temperature, weights)
    chunked, chunked_grads = _grads(model, batch, budget, temperature, weights)
    mask = batch["action_mask"].bool()
    for key in ("logprobs", "entropy"):
        assert (whole[key] - chunked[key]).abs()[mask].max() < 1e-12
    assert whole_grads.keys() == chunked_grads.keys()
    for name, grad in whole_grads.items():
        assert (grad - chunked_grads[name]).abs().max() <= 1e-10 * grad.abs().max() + 1e-14, name


def test_no_logits_tensor_grows_with_batch_times_length(model):
    """With a budget of 8 tokens per chunk, no tensor over the vocabulary has more than 8 rows,
    forward and backward, whatever the batch; without chunking the largest is the whole batch."""
    budget = 8 * VOCAB * BYTES_PER_LOGIT / 2**20
    for prompts in (2, 6):
        batch = dict(random_batch(group=4, prompts=prompts, seed=3), group_size=1)
        with LargestVocabTensor(model.config.hidden_size) as seen:
            out = policy_forward(model, batch, with_entropy=True, logits_memory_mb=budget)
            (out["logprobs"].sum() + out["entropy"].sum()).backward()
        assert seen.rows == 8
        with LargestVocabTensor(model.config.hidden_size) as whole:
            policy_forward(model, batch, logits_memory_mb=0)
        assert whole.rows >= batch["action_mask"].numel()


@pytest.mark.parametrize("model_type,scale", [("granite", {"logits_scaling": 0.125}), ("cohere", {"logit_scale": 8.0})])
def test_logits_scaled_by_a_number_are_chunked_through_the_scaled_hidden_states(model_type, scale):
    """Granite divides its logits by ``logits_scaling``, Cohere multiplies them by ``logit_scale``: with the
    head deferred the model's forward scales the hidden states instead, and the bias-free head's chunks
    then give the scaled logits -- log-probs, entropy and every gradient equal the model's own forward
    (float64), in chunks of two tokens. A scaled head with a bias is not chunked."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, **scale)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="sdpa")
    with torch.no_grad():  # logits spread as a trained model's, so that a factor of 8 changes them
        model.lm_head.weight.normal_(0, 0.1)
    batch = random_batch(group=3, prompts=2, seed=8)
    g = torch.Generator().manual_seed(9)
    weights = torch.randn(2, *batch["action_mask"].shape, generator=g, dtype=torch.float64)
    budget = 2 * VOCAB * BYTES_PER_LOGIT / 2**20
    whole, whole_grads = _grads(model, batch, 0, 0.8, weights)
    with LargestVocabTensor(model.config.hidden_size) as seen:
        chunked, chunked_grads = _grads(model, batch, budget, 0.8, weights)
    assert seen.rows == 2
    mask = batch["action_mask"].bool()
    for key in ("logprobs", "entropy"):
        assert (whole[key] - chunked[key]).abs()[mask].max() < 1e-11  # log-probs near -12 or below
    for name, grad in whole_grads.items():
        assert (grad - chunked_grads[name]).abs().max() <= 1e-10 * grad.abs().max() + 1e-14, name
    (key, value), = scale.items()
    setattr(model.config, key, 1.0)
    if model_type == "cohere":
        model.logit_scale = 1.0  # Cohere keeps its own copy
    try:
        unscaled = policy_forward(model, batch, 0.8, logits_memory_mb=0, with_entropy=True)["entropy"]
    finally:
        setattr(model.config, key, value)
        if model_type == "cohere":
            model.logit_scale = value
    assert (unscaled - whole["entropy"]).abs()[mask].max() > 0.1  # the factor matters here
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB, dtype=torch.float64))
    assert output_head(model) is None


@pytest.fixture(scope="module")
def gemma2():
    """A two-layer Gemma 2 (tied head, soft-capped attention and logits) with Qwen2.5's vocabulary, in
    float64; its logit cap lowered so that it bends this random model's small logits. transformers 5.25 runs
    Gemma 2 with eager attention only, whose padding mask turns float64 rows of padding into NaN (its softmax
    runs in float32, where float64's lowest value is -inf): there the model is float32."""
    from transformers import AutoConfig, AutoModelForCausalLM, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  query_pre_attn_scalar=32, final_logit_softcapping=0.05)
    sdpa = getattr(Gemma2ForCausalLM, "_supports_sdpa", False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64 if sdpa else torch.float32,
                                             attn_implementation="sdpa" if sdpa else "eager")
    with torch.no_grad():  # logits of a trained model's spread, about 0.1 here, so the cap of 0.05 bends them
        model.lm_head.weight.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_soft_capped_logits_are_capped_chunk_by_chunk_as_the_model_caps_them(gemma2, temperature):
    """Gemma 2 caps its logits, c tanh(z / c), in its own forward: chunked (two tokens a chunk) the
    log-probs, entropy and every gradient equal that forward's, no tensor over the vocabulary has
    more than a chunk's rows, and the model's cap is back in its config afterwards. Without the cap
    the values are far off."""
    batch = random_batch(group=3, prompts=2, seed=6)
    assert output_head(gemma2) is gemma2.lm_head
    budget = 2 * VOCAB * (BYTES_PER_LOGIT + 4) / 2**20  # soft-capped: 16 bytes a logit, two tokens a chunk
    g = torch.Generator().manual_seed(7)
    weights = torch.randn(2, *batch["action_mask"].shape, generator=g, dtype=torch.float64)
    whole, whole_grads = _grads(gemma2, batch, 0, temperature, weights)
    with LargestVocabTensor(gemma2.config.hidden_size) as seen:
        chunked, chunked_grads = _grads(gemma2, batch, budget, temperature, weights)
    assert seen.rows == 2
    assert gemma2.config.final_logit_softcapping == 0.05
    mask = batch["action_mask"].bool()
    exact = gemma2.dtype == torch.float64  # float32 where transformers runs Gemma 2 only eagerly (the fixture)
    for key in ("logprobs", "entropy"):
        assert (whole[key] - chunked[key]).abs()[mask].max() < (1e-12 if exact else 1e-5)
    for name, grad in whole_grads.items():
        assert (grad - chunked_grads[name]).abs().max() <= (1e-10 if exact else 1e-4) * grad.abs().max() + 1e-14, name
    gemma2.config.final_logit_softcapping = None
    try:
        uncapped = policy_forward(gemma2, batch, temperature, logits_memory_mb=0)["logprobs"]
    finally:
        gemma2.config.final_logit_softcapping = 0.05
    assert (uncapped - whole["logprobs"]).abs()[mask].max() > 0.1


def test_packed_micro_batches_and_lora_are_chunked_too(model):
    """A packed micro batch (one row, per-sample attention) and a PEFT-wrapped model go through the
    chunked head and give the padded, unchunked log-probs."""
    from peft import LoraConfig, get_peft_model

    from rlhf_plugins.models.packing import token_budget_split

    budget = 3 * VOCAB * BYTES_PER_LOGIT / 2**20
    batch = random_batch(group=2, prompts=3, seed=4)
    padded = policy_forward(model, batch, logits_memory_mb=0)["logprobs"]
    for part in token_budget_split(batch, 24):
        with LargestVocabTensor(model.config.hidden_size) as seen:
            packed = policy_forward(model, part, logits_memory_mb=budget)["logprobs"]
        assert seen.rows == 3
        mask = part["action_mask"].bool()
        assert (packed - padded[part["rows"]]).abs()[mask].max() < 1e-12
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    try:
        assert output_head(lora) is model.lm_head
        with LargestVocabTensor(model.config.hidden_size) as seen:
            wrapped = policy_forward(lora, batch, logits_memory_mb=budget)["logprobs"]
        assert seen.rows == 3
        assert (wrapped - padded).abs()[batch["action_mask"].bool()].max() < 1e-12  # LoRA B starts at zero
    finally:
        lora.unload()


def test_a_frozen_16_bit_head_given_the_prefills_slice_does_not_copy_its_weight_per_sample():
    """An engine's prefill keeps the last position's logits (``logits_to_keep=1``): the head gets a
    strided slice of the hidden states, which torch's CPU matmul multiplies sample by sample (bmm)
    against a copy of the frozen bf16 weight expanded to the batch (4 prompts: 4 x the 0.27 GB head of
    the Qwen2.5-0.5B shape). With the head's input made contiguous, 4 prompts allocate no more than one
    (whatever a CPU's bf16 kernels allocate per product, it does not grow with the batch)."""
    from transformers import AutoModelForCausalLM

    from rlhf_plugins.models.logits import contiguous_head_input
    from rlhf_plugins.models.shapes import shape_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(shape_config("qwen2.5-0.5b", layers=1), dtype=torch.bfloat16)
    model.requires_grad_(False)
    contiguous_head_input(model)
    largest = {}
    with torch.inference_mode():
        for prompts in (1, 4):
            ids = torch.randint(10, 1000, (prompts, 60))
            largest[prompts] = largest_allocation(partial(model, input_ids=ids, use_cache=True, logits_to_keep=1))
    head_bytes = model.get_output_embeddings().weight.nbytes
    assert largest[4] < largest[1] + head_bytes / 4, (largest, head_bytes)  # the copies: 4 x head_bytes


def test_every_model_loaded_for_a_role_hands_its_head_a_contiguous_input():
    from rlhf_plugins.api import prepare
    from rlhf_plugins.models.tiny_model import default_model_path

    config, pm, _ = prepare({}, autoload=False)
    model = pm.load_model("generation", default_model_path(), config)
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].is_contiguous()))
    with torch.inference_mode():
        model(input_ids=torch.randint(10, 300, (3, 9)), use_cache=True, logits_to_keep=1)
    assert seen == [True]
