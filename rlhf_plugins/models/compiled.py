"""``--learner.compile``: the learner's decoder norms and MLPs compiled with ``torch.compile`` (the torch
learner, and the FSDP2 learner inside each of its units, where they run on the gathered weights).

Around its matrix products a decoder layer does elementwise work that eager torch runs as one kernel
(and one trip through memory) per operation: an RMSNorm is five passes over the hidden states in
float32 (square, mean, reciprocal square root, two products) forward and more backward, a SwiGLU MLP
two more (SiLU of the gate, times the up projection). Compiled, each becomes one or two fused kernels
forward and backward, which is what Liger's kernels do by hand. The output head, when it is a plain
linear layer, is marked so that each chunk's log-softmax, gather, entropy and their gradient run
compiled around its matrix products (:mod:`.fused_head`). The matrix products are left to cuBLAS;
attention (with this package's KV caches and masks) is not compiled.

What is compiled: every module whose class is an RMSNorm (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ...) and
every decoder layer's dense MLP (``mlp`` of a class named ``...MLP``; a mixture of experts' routing
block is left eager). Shapes are compiled dynamic from the first call: micro batches of other lengths,
the shared-prefix forward's prompt and completion parts and the no-grad old-log-prob pass reuse the
same kernels instead of compiling again. The first update pays the compilation (seconds on a
CPU for a small model, more for a large one; Triton on a GPU).
"""
from __future__ import annotations

import logging
import shutil
from typing import Any

import torch

from ..errors import ConfigError
from .fused_head import COMPILED, fusable
from .logits import output_head

logger = logging.getLogger("rlhf_plugins")


def compilable(module: torch.nn.Module) -> bool:
    """An RMSNorm, or a dense MLP block (not a mixture of experts)."""
    name = type(module).__name__
    return name.endswith("RMSNorm") or (name.endswith("MLP") and "Moe" not in name and "MoE" not in name)


def cpu_compiler() -> str | None:
    """The C++ compiler torch.compile would use on a CPU, if this machine has one."""
    return next((cc for cc in ("c++", "g++", "clang++") if shutil.which(cc)), None)


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


def compile_blocks(model: Any, device: torch.device, role: str = "actor") -> int:
    """Compile ``model``'s RMSNorms and dense MLPs in place (``nn.Module.compile``: the module keeps
    its parameters, names and hooks; only its call runs compiled). Returns how many were compiled."""
    check_compiler(device)
    blocks = [m for m in model.modules() if compilable(m)]
    if not blocks:
        raise ConfigError(f"learner.compile: {type(model).__name__} has no RMSNorm or MLP block to compile; "
                          "drop --learner.compile")
    for block in blocks:
        block.compile(dynamic=True)
    head = output_head(model)
    marked = head is not None and fusable(head)
    if marked:  # the chunked head's elementwise work (fused_head.py)
        setattr(head, COMPILED, True)
    kinds = sorted({type(b).__name__ for b in blocks})
    logger.info("learner.compile: %d blocks of the %s compiled (%s)%s; its first update compiles their kernels",
                len(blocks), role, ", ".join(kinds), " and its output head's log-softmax" if marked else "")
    return len(blocks)


def compiled_blocks(model: Any) -> list[str]:
    """The names of ``model``'s modules whose call runs compiled."""
    return [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
