"""What each role needs in memory, from the model's shape and the run's config.

Every number here is an *analytic minimum*: the bytes of tensors the role cannot do without --
weights, gradients and optimizer states in their dtypes and shards, the activations of one training
micro batch, one chunk of output-head logits, the KV cache -- not what a process happens to hold.
Runs print it next to the node's memory before launch (refusing layouts whose minimum cannot fit),
log each role's measured peak beside it, and ``bench/scale.py`` compares the two.

Learners and engines declare their own memory model (``LearnerBackend.memory`` /
``GenerationBackend.memory``: ``fn(MemoryInputs) -> {item: bytes}``); the builtin ones are below.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model_shape import ModelShape  # also imported from here: half of what a memory model sees

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: bytes of one Adam(W) state element per parameter (exp_avg + exp_avg_sq) in units of the state dtype
ADAM_STATES = 2


@dataclass(frozen=True)
class MemoryInputs:
    """What a memory model sees: the run's config, the role's model shape, its ranks and workload."""

    config: Any
    shape: ModelShape
    role: str
    #: data-parallel ranks of the role (the learner shards over them)
    ranks: int
    #: trainable parameters (all of them, or the LoRA adapters)
    trainable: int
    #: tokens of one training micro batch on one rank
    micro_tokens: int
    #: bytes of one chunk of output-head logits (the whole batch's when not chunked)
    logits_bytes: int
    #: sequences one generation call holds at once, and their longest prompt and completion
    sequences: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.config.model.dtype]

    @property
    def average_bytes(self) -> int:  # the actor's float32 average of its weights (--learner.ema), unsharded
        return self.trainable * 4 if self.role == "actor" and self.config.learner.ema else 0


def float32_head_bytes(m: MemoryInputs) -> int:
    """What ``--model.fp32_lm_head`` adds to a 16-bit model's weights: its head (and a tied embedding) in
    float32, 2 more bytes per element."""
    return m.shape.vocab * m.shape.hidden * (4 - m.dtype_bytes) if m.config.model.fp32_lm_head else 0


def activations(m: MemoryInputs) -> int:
    c = m.config.learner
    per_layer = m.shape.activation_elements_per_token(compiled=c.compile) * m.dtype_bytes
    if c.gradient_checkpointing:  # each layer's input kept, one layer's activations recomputed at a time
        return m.micro_tokens * (m.shape.layers * m.shape.hidden * m.dtype_bytes + per_layer)
    return m.micro_tokens * m.shape.layers * per_layer


def optimizer_states(m: MemoryInputs) -> int:
    """Optimizer state elements of the trainable parameters, unsharded: Adam(W)'s two, SGD's momentum,
    Muon's momentum on the hidden matrices (all of LoRA's adapters) beside AdamW's two on the rest, or
    Adafactor's factored second moments (a LoRA adapter's rows and columns: left out, a few thousand)."""
    c, T = m.config.learner_of(m.role), m.trainable  # the critic's optimizer may be its own
    if c.optimizer == "sgd":
        return T if c.momentum else 0
    if c.optimizer == "adafactor":
        return m.shape.factored_states if T == m.shape.parameters else 0
    if c.optimizer != "muon":
        return T * ADAM_STATES
    matrices = m.shape.matrix_parameters if T == m.shape.parameters else T
    return matrices + (T - matrices) * ADAM_STATES


def torch_learner_memory(m: MemoryInputs) -> dict[str, int]:
    """One rank holding float32 gradients and optimizer states; weights in float32, or in 16 bits beside
    float32 masters of the trainable ones (16-bit runs; the 16-bit gradients move onto their masters a
    bucket of about 32 MB at a time, at most 128 MB waiting: left out here; LoRA's float32 adapters and
    a float32 head are their own masters). With ``--learner.master_weights false`` 16-bit runs keep
    float32 weights and run forwards under autocast."""
    masters = m.dtype_bytes < 4 and m.config.learner.master_weights
    full = m.trainable == m.shape.parameters
    head = float32_head_bytes(m) if masters else 0  # a trained float32 head is its own master
    own = m.shape.vocab * m.shape.hidden * 4 if head and full else 0
    return {k: v for k, v in {
        "weights": m.shape.parameters * (m.dtype_bytes if masters else 4),
        "float32 head": head,
        "fp32 master weights": m.trainable * 4 - own if masters and full else 0,
        "float32 adapters": m.trainable * 4 if not full else 0,  # LoRA's, as PEFT makes them: their own masters
        "gradients": m.trainable * 4,
        "optimizer states": optimizer_states(m) * 4,
        "weight average": m.average_bytes,
        "activations": activations(m),
        "logits chunk": m.logits_bytes,
    }.items() if v}


def deepspeed_learner_memory(m: MemoryInputs) -> dict[str, int]:
    """ZeRO stage s over ``ranks``: stage >= 1 shards the fp32 master weights and optimizer states,
    >= 2 the gradients, 3 the weights (a rank then holds one gathered layer or embedding at a time)."""
    stage, n, b = m.options.get("zero_stage", 0), max(1, m.ranks), m.dtype_bytes
    P, T = m.shape.parameters, m.trainable
    out = {"weights": P * b // n if stage == 3 else P * b}
    if stage == 3:  # one layer or the embedding gathered; over several ranks, in the backward, also its full
        # gradient and the reduce-scatter's buffer (a 0.6B rank of two: 3.7x the embedding above steady)
        gathered = max(m.shape.layer_parameters, m.shape.largest_tensor) * b
        out["gathered tensor"] = gathered
        out["gathered tensor's gradient"] = 2 * gathered if n > 1 and T == P else 0
    # ZeRO keeps an fp32 master partition; under ZeRO-3 float32 weights are their own master (the
    # learner shares them: deepspeed_learner.share_master_weights), unless the optimizer is offloaded
    shared = stage == 3 and b == 4 and not m.options.get("offload_optimizer")
    out["fp32 master weights"] = T * 4 // n if stage >= 1 and not shared else 0
    out["gradients"] = T * (4 if stage >= 1 else b) // (n if stage >= 2 else 1)
    if m.options.get("offload_optimizer"):  # the offloaded optimizer's own float32 gradient partition
        out["offloaded gradients"] = T * 4 // n  # (stage3.py initialize_optimizer_states: one per sub-group)
    states = optimizer_states(m) * (4 if stage >= 1 else b)
    out["optimizer states"] = states // (n if stage >= 1 else 1)
    out["weight average"] = m.average_bytes // (n if stage == 3 else 1)
    out["reduce bucket"] = zero_bucket_elements(m.shape) * 4 if stage >= 2 else 0
    out["activations"] = activations(m)
    out["logits chunk"] = m.logits_bytes
    return {k: v for k, v in out.items() if v}


def fsdp_learner_memory(m: MemoryInputs) -> dict[str, int]:
    """FSDP2 over ``ranks``: float32 weight, gradient and optimizer-state shards (in CPU memory with
    ``offload_params``), plus one decoder layer gathered in the compute dtype and the next prefetched
    (the root's embeddings and head while they compute). The frozen reference: shards in its own dtype,
    no gradients or optimizer, a forward's activations."""
    n, b = max(1, m.ranks), m.dtype_bytes
    P, T = m.shape.parameters, m.trainable
    if m.role == "reference":
        frozen = {**reference_memory(m), "weights": P * b // n, "float32 head": float32_head_bytes(m) // n,
                  "gathered layers": 2 * max(m.shape.layer_parameters, m.shape.largest_tensor) * b}
        return {k: v for k, v in frozen.items() if v}
    return {k: v for k, v in {
        "weights": P * 4 // n,
        "gathered layers": 2 * max(m.shape.layer_parameters, m.shape.largest_tensor) * b,
        "float32 head": float32_head_bytes(m),  # the root unit gathered in float32
        "gradients": T * 4 // n,
        "optimizer states": optimizer_states(m) * 4 // n,
        "weight average": m.average_bytes // n,
        "activations": activations(m),
        "logits chunk": m.logits_bytes,
    }.items() if v}


def zero_bucket_elements(shape: ModelShape) -> int:
    """DeepSpeed's reduce and all-gather buckets sized from the model: its largest decoder layer (at
    least hidden^2, transformers' "auto"), never DeepSpeed's default of 5e8 elements (2 GB of float32
    per bucket, allocated at start whatever the model)."""
    return int(min(5e8, max(shape.hidden**2, shape.layer_parameters)))


def streamed_staging(shape: ModelShape, whole: int, bucket: int) -> int:
    """What an engine that loads a sync as it arrives holds of it (``whole``: the weights in its
    dtype): the bucket in flight (a tensor larger than a bucket travels alone), an earlier bucket the
    layer under way began in, and the engine's new copy of that layer or tensor (vLLM rebuilds a layer
    before it copies it into its kernels: measured at 0.5B, 1.3 GB above the engine's steady state
    while the 0.54 GB embedding loads)."""
    size = whole / max(shape.parameters, 1)
    largest = max(shape.layer_parameters, shape.largest_tensor) * size
    return int(min(whole, max(bucket, shape.largest_tensor * size) + bucket + largest))


def kv_cache_bytes(m: MemoryInputs, block: int = 1) -> int:
    """Keys and values of every sequence of one generation call at its full length (in blocks)."""
    length = math.ceil((m.prompt_tokens + m.completion_tokens) / block) * block
    return m.sequences * length * m.shape.kv_elements_per_token * m.dtype_bytes


def transformers_engine_memory(m: MemoryInputs) -> dict[str, int]:
    """Weights, a KV cache reserved for prompt + budget, and one decode step's float32 logits,
    log-softmax and probabilities."""
    return {k: v for k, v in {
        "weights": m.shape.parameters * m.dtype_bytes,
        "float32 head": float32_head_bytes(m),
        "KV cache": kv_cache_bytes(m),
        "decode logits": m.sequences * m.shape.vocab * 4 * 3,
    }.items() if v}


def reference_memory(m: MemoryInputs) -> dict[str, int]:
    """The frozen policy: weights, one layer's activations at a time, one chunk of logits."""
    return {k: v for k, v in {
        "weights": m.shape.parameters * m.dtype_bytes,
        "float32 head": float32_head_bytes(m),
        "activations": m.micro_tokens * m.shape.activation_elements_per_token() * m.dtype_bytes,
        "logits chunk": m.logits_bytes,
    }.items() if v}


def this_machine(config: Any = None) -> int:
    """Bytes of memory this process may use: the machine's, or its container's limit when lower."""
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def gib(n: float) -> str:
    """Bytes for a reader: GB above a gigabyte, MB below."""
    return f"{n / GIB:.2f} GB" if n >= GIB else f"{n / 2**20:.0f} MB"
