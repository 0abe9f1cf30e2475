"""16-bit working weights with float32 master copies: the torch learner's mixed precision for
``--model.dtype bfloat16`` (or float16), as DeepSpeed's bf16 mode and Megatron train.

The model keeps its 16-bit weights: forwards and backwards run in them with no casts (under
``torch.autocast`` every forward casts each float32 weight to 16 bits and every backward casts its
gradient back; the residual stream stays float32). The optimizer owns float32 copies of the trainable
parameters and their float32 gradients, kept allocated from step to step. As soon as a parameter's
16-bit gradient is complete in the backward pass it is added to its master's gradient and freed
(``register_post_accumulate_grad_hook``), so micro batches accumulate in float32 and at most one 16-bit
gradient exists at a time. Each parameter also carries its master's gradient as ``main_grad``
(Megatron's name): a fused kernel adds its weight gradient there in float32 and gives autograd none
(:mod:`rlhf_plugins.models.fused_head` does, for the output head). After the optimizer's step the
masters are written back into the 16-bit weights. The learner computes exactly as the generation
engine does (same weights, same dtypes), and an engine in the same process can read its parameters.

Checkpoints hold the masters under the model's names (float32, as the autocast learner saved its
float32 weights), so a resume continues from full-precision weights.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch


class MasterWeights:
    def __init__(self, model: torch.nn.Module) -> None:
        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.masters = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for _, p in self.named]
        for (_, p), master in zip(self.named, self.masters):
            master.grad = torch.zeros_like(master)
            p.main_grad = master.grad
        self.handles = [p.register_post_accumulate_grad_hook(partial(_to_master, master))
                        for (_, p), master in zip(self.named, self.masters)]

    @torch.no_grad()
    def write_back(self) -> None:
        """The masters, after an optimizer step, into the 16-bit weights: one multi-tensor copy (a few
        kernel launches on a GPU instead of one per parameter, 290 for a Qwen2.5-0.5B)."""
        torch._foreach_copy_([p for _, p in self.named], self.masters)

    def state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's state dict with every trainable tensor replaced by its float32 master (a tied
        tensor's names all point at the one master)."""
        masters = {p.data_ptr(): m.detach() for (_, p), m in zip(self.named, self.masters)}
        return {name: masters.get(t.data_ptr(), t) for name, t in model.state_dict().items()}

    @torch.no_grad()
    def load(self, model: torch.nn.Module, folder: str | Path) -> None:
        """The masters from a checkpoint's shards (which :meth:`state_dict` wrote), read by name one
        tensor at a time; a parameter the shards do not name under any of its aliases starts from its
        16-bit value."""
        from safetensors import safe_open

        from ..models.empty_init import checkpoint_tensors

        names: dict[int, list[str]] = {}
        for name, t in model.state_dict().items():
            names.setdefault(t.data_ptr(), []).append(name)
        stored = checkpoint_tensors(folder)
        for (_, p), master in zip(self.named, self.masters):
            name = next((n for n in names.get(p.data_ptr(), []) if n in stored), None)
            if name is None:
                master.copy_(p)
                continue
            with safe_open(str(Path(folder) / stored[name][0]), "pt") as f:
                master.copy_(f.get_tensor(name))


def _to_master(master: torch.Tensor, param: torch.Tensor) -> None:
    """Move a parameter's completed 16-bit gradient onto its float32 master (none when a fused kernel
    added it to ``main_grad`` itself)."""
    if param.grad is not None:
        master.grad.add_(param.grad)
        param.grad = None
