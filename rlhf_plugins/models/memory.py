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

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: bytes of one Adam(W) state element per parameter (exp_avg + exp_avg_sq) in units of the state dtype
ADAM_STATES = 2


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a decoder-only model's memory (counted exactly on the meta device)."""

    parameters: int
    #: parameters of the largest decoder layer (what ZeRO-3 gathers at once, besides the embedding)
    layer_parameters: int
    #: elements of the largest single tensor (usually the embedding)
    largest_tensor: int
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    q_dim: int
    kv_dim: int
    tied: bool
    #: the longest context the model takes (max_position_embeddings), when it says
    max_positions: int | None = None
    #: a mixture of experts: experts per layer, experts per token and one expert's width (0: dense)
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0

    @property
    def kv_elements_per_token(self) -> int:
        """Keys and values of one token over all layers."""
        return 2 * self.layers * self.kv_dim

    def activation_elements_per_token(self, compiled: bool = False) -> int:
        """Elements one token of a training micro batch keeps for the backward pass in one layer
        (norm inputs and outputs, q/k/v and their rotary forms, attention output, the MLP's gate, up,
        activation and product): checked against the saved tensors of a real forward within 15%.
        ``compiled`` (``--learner.compile``): the compiled norms keep their inputs and recompute their
        outputs in the backward pass, the compiled MLP recomputes its activation (2 hidden-sized and 3
        intermediate-sized elements instead of 6 and 4), checked the same way."""
        norms_attention = (2 if compiled else 6) * self.hidden + 6 * self.q_dim + 4 * self.kv_dim
        if self.experts_per_token:  # the routed block (eager even when compiled)
            return norms_attention + self.moe_elements_per_token()
        return norms_attention + (3 if compiled else 4) * self.intermediate

    def moe_elements_per_token(self) -> int:
        """A mixture-of-experts block (transformers' experts loop): per token, each of its k experts
        keeps the gathered input, gate-up output, activation, product and weighted output (2kH + 4kI),
        the router its probabilities (2E); within 2% of the saved tensors of a Qwen3-MoE forward."""
        k, width = self.experts_per_token, self.expert_intermediate
        return 2 * k * self.hidden + 4 * k * width + 2 * self.experts

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = list(model.parameters())
        layers = _decoder_layers(model)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        out = model.get_output_embeddings()
        return cls(
            parameters=sum(p.numel() for p in params),
            layer_parameters=max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0),
            largest_tensor=max(p.numel() for p in params),
            vocab=config.vocab_size,
            hidden=config.hidden_size,
            intermediate=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            layers=len(layers) or config.num_hidden_layers,
            q_dim=heads * head_dim,
            kv_dim=kv_heads * head_dim,
            tied=out is not None and out.weight is model.get_input_embeddings().weight,
            max_positions=getattr(config, "max_position_embeddings", None),
            **_experts(config),
        )

    @classmethod
    def of_folder(cls, path: str | Path, trust_remote_code: bool = False) -> ModelShape:
        return _shape_of(str(Path(path).expanduser().resolve()), trust_remote_code)


@functools.lru_cache(maxsize=8)
def _shape_of(path: str, trust_remote_code: bool) -> ModelShape:
    from transformers import AutoConfig

    return ModelShape.from_config(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))


def _experts(config: Any) -> dict[str, int]:
    """A mixture of experts' sizes from its config (Qwen-MoE ``num_experts``, Mixtral
    ``num_local_experts``; an expert's width is ``moe_intermediate_size`` or else the MLP's)."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    per_token = getattr(config, "num_experts_per_tok", None) or 0
    if not experts or not per_token:
        return {}
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return dict(experts=int(experts), experts_per_token=int(per_token), expert_intermediate=int(width))


def _decoder_layers(model: Any) -> list[Any]:
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    return list(max(lists, key=len)) if lists else []


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


def activations(m: MemoryInputs) -> int:
    c = m.config.learner
    per_layer = m.shape.activation_elements_per_token(compiled=c.compile) * m.dtype_bytes
    if c.gradient_checkpointing:  # each layer's input kept, one layer's activations recomputed at a time
        return m.micro_tokens * (m.shape.layers * m.shape.hidden * m.dtype_bytes + per_layer)
    return m.micro_tokens * m.shape.layers * per_layer


def optimizer_elements(config: Any) -> int:
    c = config.learner
    return (1 if c.momentum else 0) if c.optimizer == "sgd" else ADAM_STATES


def torch_learner_memory(m: MemoryInputs) -> dict[str, int]:
    """One rank holding float32 gradients and optimizer states; weights in float32, or in 16 bits beside
    float32 masters of the trainable ones (16-bit runs; each 16-bit gradient is moved onto its master
    as it completes). With ``--learner.master_weights false`` 16-bit runs keep float32 weights and run
    forwards under autocast."""
    masters = m.dtype_bytes < 4 and m.config.learner.master_weights
    return {k: v for k, v in {
        "weights": m.shape.parameters * (m.dtype_bytes if masters else 4),
        "fp32 master weights": m.trainable * 4 if masters else 0,
        "gradients": m.trainable * 4,
        "optimizer states": m.trainable * 4 * optimizer_elements(m.config),
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
    states = T * 4 * optimizer_elements(m.config) if stage >= 1 else T * b * optimizer_elements(m.config)
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
        frozen = {**reference_memory(m), "weights": P * b // n,
                  "gathered layers": 2 * max(m.shape.layer_parameters, m.shape.largest_tensor) * b}
        return {k: v for k, v in frozen.items() if v}
    return {k: v for k, v in {
        "weights": P * 4 // n,
        "gathered layers": 2 * max(m.shape.layer_parameters, m.shape.largest_tensor) * b,
        "gradients": T * 4 // n,
        "optimizer states": T * 4 * optimizer_elements(m.config) // n,
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
    return {
        "weights": m.shape.parameters * m.dtype_bytes,
        "KV cache": kv_cache_bytes(m),
        "decode logits": m.sequences * m.shape.vocab * 4 * 3,
    }


def reference_memory(m: MemoryInputs) -> dict[str, int]:
    """The frozen policy: weights, one layer's activations at a time, one chunk of logits."""
    return {
        "weights": m.shape.parameters * m.dtype_bytes,
        "activations": m.micro_tokens * m.shape.activation_elements_per_token() * m.dtype_bytes,
        "logits chunk": m.logits_bytes,
    }


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
