"""``--learner.compile``: the learner's decoder norms and MLPs (or whole decoder layers) compiled with
``torch.compile`` (the torch learner, and the FSDP2 learner inside each of its units, where they run on
the gathered weights).

Around its matrix products a decoder layer does elementwise work that eager torch runs as one kernel
(and one trip through memory) per operation: an RMSNorm is five passes over the hidden states in
float32 (square, mean, reciprocal square root, two products) forward and more backward, a SwiGLU MLP
two more (SiLU of the gate, times the up projection). Compiled, each becomes one or two fused kernels
forward and backward, which is what Liger's kernels do by hand. The output head, when it is a plain
linear layer, is marked so that each chunk's log-softmax, gather, entropy and their gradient run
compiled around its matrix products (:mod:`.fused_head`). The matrix products are left to cuBLAS.

What is compiled (``--learner.compile_scope blocks``, the default): every module whose class is an
RMSNorm (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ...) and every decoder layer's dense MLP (``mlp`` of a
class named ``...MLP``; a mixture of experts' routing block is left eager); attention (with this
package's KV caches and masks) is not. Shapes are compiled dynamic from the first call: micro batches
of other lengths, the shared-prefix forward's prompt and completion parts and the no-grad
old-log-prob pass reuse the same kernels instead of compiling again. The first update pays the compilation (seconds on a
CPU for a small model, more for a large one; Triton on a GPU).

``--learner.compile_scope layers`` compiles each dense decoder layer whole (and the final norm): also
the rotary embedding, the projections' reshapes and the residual adds, for fewer kernels per layer
where a small model's update waits on launching them. All layers share one compiled code (their
index is a symbolic integer, not a constant to recompile for), and the shared-prompt forward's KV
cache is updated outside the graph (:mod:`.prompt_cache`, or :class:`EagerUpdateCache` for layers it
does not serve): otherwise each layer index and each
cache state would be compiled apart, soon past dynamo's limit of eight versions (after which the
layers run eagerly). A mixture-of-experts layer keeps its routing eager (its norms are compiled).

``--learner.compile_mode`` is torch.compile's mode. ``reduce-overhead`` (and ``max-autotune``) replay
each compiled module's kernels as a CUDA graph, one launch where eager issues dozens: the lever for an
update that waits on the host to issue kernels (docs/gpu.md). Only the training forward and its
backward replay graphs; the passes without gradients run the same compiled code without them (each
call there would begin a new graph generation and free what earlier layers left in the KV cache).
A graph is recorded per shape, so it pays where shapes repeat (fixed-length completions); on a CPU
the mode runs without graphs, with one line saying so. The weights' gradients then stay allocated
from update to update (:func:`keep_grads_allocated`).
"""
from __future__ import annotations

import logging
import shutil
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from ..errors import ConfigError
from .fused_head import COMPILED, fusable
from .logits import output_head

logger = logging.getLogger("rlhf_plugins")

#: torch.compile's modes (``--learner.compile_mode``) whose compiled code replays CUDA graphs
GRAPHED_MODES = ("reduce-overhead", "max-autotune")
#: set on a model whose decoder layers run compiled (``--learner.compile_scope layers``)
LAYERS = "_rlhf_compiled_layers"


def _mixture_of_experts(module: torch.nn.Module) -> bool:
    """A block routing tokens among experts: it holds an ``experts`` module (Mixtral, Qwen-MoE,
    DeepSeek, gpt-oss, whose block is named ``GptOssMLP``) or its class says so. A dense MLP of an
    MoE model (``Qwen3MoeMLP``: a shared expert, an ``mlp_only_layers`` layer) is not one."""
    name = type(module).__name__
    return "experts" in module._modules or "SparseMoe" in name or name.endswith(("MoE", "Moe"))


def compilable(module: torch.nn.Module) -> bool:
    """An RMSNorm, or a dense MLP block (not a mixture of experts)."""
    name = type(module).__name__
    return name.endswith("RMSNorm") or (name.endswith("MLP") and not _mixture_of_experts(module))


def cpu_compiler() -> str | None:
    """The C++ compiler torch.compile would use on a CPU, if this machine has one."""
    return next((cc for cc in ("c++", "g++", "clang++") if shutil.which(cc)), None)


def replays_graphs(learner: Any) -> bool:
    """The learner section ``learner`` asks for compiled modules that replay CUDA graphs."""
    return bool(learner.compile) and learner.compile_mode in GRAPHED_MODES


def check_compiler(device: torch.device) -> None:
    """torch.compile's backend can write kernels for ``device``: Triton for a GPU, a C++ compiler
    for a CPU. One line otherwise, before the model is touched."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():  # pragma: no cover - torch's CUDA wheels carry Triton
            raise ConfigError("learner.compile on a GPU needs Triton (it ships with torch's CUDA wheels); install "
                              "triton or drop --learner.compile")
    elif device.type == "cpu" and cpu_compiler() is None:
        raise ConfigError("learner.compile on a CPU needs a C++ compiler (torch.compile writes C++ kernels): "
                          "install g++ or drop --learner.compile")


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers: modules of the classes transformers marks as not to be split
    (``_no_split_modules``), found in the model or the model it wraps."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def dense_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers ``--learner.compile_scope layers`` compiles whole: all but those holding a
    mixture of experts (whose routing stays eager; their norms are compiled as blocks)."""
    return [layer for layer in decoder_layers(model) if not any(map(_mixture_of_experts, layer.modules()))]


def compile_blocks(model: Any, device: torch.device, role: str = "actor", scope: str = "blocks",
                   mode: str = "default") -> int:
    """Compile ``model``'s RMSNorms and dense MLPs, or with ``scope="layers"`` its dense decoder layers
    whole and the norms outside them, in place (``nn.Module.compile``: the module keeps its parameters,
    names and hooks; only its call runs compiled), in torch.compile's ``mode``. Returns how many
    modules were compiled."""
    check_compiler(device)
    mode = graph_mode(mode, device)
    layers = dense_layers(model) if scope == "layers" else []
    inside = {id(m) for layer in layers for m in layer.modules()}
    blocks = [m for m in model.modules() if compilable(m) and id(m) not in inside]
    if not layers and not blocks:
        raise ConfigError(f"learner.compile: {type(model).__name__} has no RMSNorm or MLP block to compile; "
                          "drop --learner.compile")
    for block in blocks:
        _compile(block, mode)
    for layer in layers:
        _compile(layer, mode)
        layer._compiled_call_impl = _unspecialized(layer._compiled_call_impl)
    setattr(model, LAYERS, bool(layers))
    head = output_head(model)
    marked = head is not None and fusable(head)
    if marked:  # the chunked head's elementwise work (fused_head.py)
        setattr(head, COMPILED, True)
    kinds = sorted({type(b).__name__ for b in layers + blocks})
    logger.info("learner.compile: %d modules of the %s compiled (%s)%s; its first update compiles their kernels",
                len(layers) + len(blocks), role, ", ".join(kinds),
                " and its output head's log-softmax" if marked else "")
    return len(layers) + len(blocks)


def graph_mode(mode: str, device: torch.device) -> str:
    """``mode`` where it can run: CUDA graphs need a GPU, so on another device a mode that replays
    them runs without (said in one line)."""
    if mode in GRAPHED_MODES and device.type != "cuda":
        logger.warning("learner.compile_mode %s: CUDA graphs need a GPU; on the %s the compiled modules run "
                       "without them", mode, device.type.upper())
        return "max-autotune-no-cudagraphs" if mode == "max-autotune" else "default"
    return mode


def _compile(module: torch.nn.Module, mode: str) -> None:
    """``module`` compiled in ``mode``. With CUDA graphs its call under autograd (a training forward,
    whose backward keeps every layer's call in one graph generation) replays them, and its calls
    without gradients (old log-probs, the reference, generation) run the same kernels without: there
    each call would start a new generation and free the tensors earlier calls left in the KV cache."""
    module.compile(dynamic=True, **({} if mode == "default" else {"mode": mode}))
    if mode in GRAPHED_MODES:
        graphed, plain = module._compiled_call_impl, torch.compile(module._call_impl, dynamic=True)

        def call(*args: Any, **kwargs: Any) -> Any:
            return (graphed if torch.is_grad_enabled() else plain)(*args, **kwargs)
        module._compiled_call_impl = call


def keep_grads_allocated(params: list[torch.Tensor]) -> None:
    """Give every parameter of ``params`` a zero gradient before any backward, so that backwards add
    to it in place. With CUDA graphs a compiled backward's weight gradients are tensors of the graph
    tree's memory pool, and a parameter whose ``.grad`` is None takes that very tensor as its gradient;
    the next micro batch's forward begins a new graph generation, which frees it, and its backward then
    adds to freed memory (torch raises "accessing tensor output of CUDAGraphs that has been
    overwritten by a subsequent run"; run 7 in docs/gpu.md). The float32 masters of 16-bit runs have
    theirs already, allocated once, and each 16-bit gradient is moved onto them as soon as it is
    complete (:mod:`rlhf_plugins.learners.master_weights`); a 16-bit run's float32 parameters (LoRA's
    adapters, a float32 head), their own masters, get one here."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def compiled_blocks(model: Any) -> list[str]:
    """The names of ``model``'s modules whose call runs compiled."""
    return [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]


def _unspecialized(compiled: Any) -> Any:
    """A decoder layer's compiled call, traced with the module's integer attributes (its
    ``layer_idx``) as symbolic inputs: every layer runs the same compiled code."""
    config = torch._dynamo.config

    def call(*args: Any, **kwargs: Any) -> Any:
        # set and restored by hand: ``config.patch`` costs about four times as much, on every call
        before, config.allow_unspec_int_on_nn_module = config.allow_unspec_int_on_nn_module, True
        try:
            return compiled(*args, **kwargs)
        finally:
            config.allow_unspec_int_on_nn_module = before
    return call


class EagerUpdateCache(DynamicCache):
    """transformers' dynamic cache, updated eagerly between two compiled parts of each layer: inside
    the graph, the update would tie the compiled code to the layer's index and the cache's state."""

    @torch.compiler.disable
    def update(self, *args: Any, **kwargs: Any) -> Any:
        return super().update(*args, **kwargs)


def layer_cache(model: Any) -> EagerUpdateCache | None:
    """The KV cache of ``model``'s shared-prompt forward where :mod:`.prompt_cache` has none (sliding
    windows, the speed machinery off): an :class:`EagerUpdateCache` when its decoder layers run
    compiled, else None (transformers makes its own)."""
    return EagerUpdateCache(config=model.config) if getattr(model, LAYERS, False) else None
