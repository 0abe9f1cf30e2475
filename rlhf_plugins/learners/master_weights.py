"""16-bit working weights with float32 master copies: the torch learner's mixed precision for
``--model.dtype bfloat16`` (or float16), as DeepSpeed's bf16 mode and Megatron train.

The model keeps its 16-bit weights: forwards and backwards run in them with no casts (under
``torch.autocast`` every forward casts each float32 weight to 16 bits and every backward casts its
gradient back; the residual stream stays float32). The optimizer owns float32 copies of the trainable
parameters and their float32 gradients (one buffer), kept allocated from step to step. As soon as a
parameter's 16-bit gradient is complete in the backward pass it is taken from the parameter
(``register_post_accumulate_grad_hook``); once every parameter of its bucket -- consecutive parameters
of about :data:`BUCKET_BYTES` of 16-bit gradient, DDP's buckets -- has one, the bucket's gradients are
added onto their masters' at once: one concatenation and one add per bucket where a per-parameter move
launches one add per parameter (290 for a Qwen2.5-0.5B, each a kernel launch on a GPU). So micro
batches accumulate in float32. A bucket some of whose parameters get no gradient from autograd in a
backward (experts no token reached, a fused head's weight) moves as the backward ends, or sooner, one
gradient at a time, once more than :data:`HELD_BUCKETS` buckets' worth of gradients wait: at most
about that much 16-bit gradient is held at any time (128 MB), where the whole of it is 2 bytes per
parameter. With CUDA graphs (a graph
``--learner.compile_mode``) every gradient moves as it completes (``bucket_bytes=0``): a gradient the
compiled backward made lives in the graphs' memory pool and must leave it before the next graph runs.
Each parameter also carries its master's gradient as ``main_grad``
(Megatron's name): a fused kernel adds its weight gradient there in float32 and gives autograd none
(:mod:`rlhf_plugins.models.fused_head` does, for the output head). After the optimizer's step the
masters are written back into the 16-bit weights. A parameter already in float32 (the output head of
``--model.fp32_lm_head``) is its own master: the optimizer steps it, its gradient stays on it. The
learner computes exactly as the generation engine does (same weights, same dtypes), and an engine in
the same process can read its parameters.

Checkpoints hold the masters under the model's names (float32, as the autocast learner saved its
float32 weights), so a resume continues from full-precision weights.
"""
from __future__ import annotations

from functools import partial
from itertools import accumulate
from pathlib import Path

import torch

#: about this many bytes of 16-bit gradient move onto their masters together (one bucket)
BUCKET_BYTES = 32 * 2**20
#: buckets' worth of 16-bit gradients that may wait for the rest of their buckets
HELD_BUCKETS = 4


class MasterWeights:
    def __init__(self, model: torch.nn.Module, bucket_bytes: int = BUCKET_BYTES) -> None:
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        #: the 16-bit trainable parameters, each with a float32 master
        self.named = [(name, p) for name, p in trainable if p.dtype in (torch.bfloat16, torch.float16)]
        self.masters = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for _, p in self.named]
        masters = {id(p): master for (_, p), master in zip(self.named, self.masters)}
        #: what the optimizer steps, in the model's order: a 16-bit parameter's master, a float32 parameter
        #: (a float32 head, ``--model.fp32_lm_head``) itself
        self.params = [masters.get(id(p), p) for _, p in trainable]
        sizes = [p.numel() for _, p in self.named]
        self.offsets = [0, *accumulate(sizes)]
        device = self.named[0][1].device if self.named else None
        #: the masters' float32 gradients, one buffer: a bucket's are one slice of it
        self.grad = torch.zeros(self.offsets[-1], dtype=torch.float32, device=device)
        for i, ((_, p), master) in enumerate(zip(self.named, self.masters)):
            master.grad = self.grad[self.offsets[i]:self.offsets[i + 1]].view_as(master)
            p.main_grad = master.grad
        self.buckets = _buckets([p.nbytes for _, p in self.named], bucket_bytes)
        self._bucket_of = {i: b for b, span in enumerate(self.buckets) for i in span}
        self._waiting: dict[int, dict[int, torch.Tensor]] = {}
        self._most_held = HELD_BUCKETS * bucket_bytes
        #: bytes of 16-bit gradient waiting now
        self.held = 0
        self._flush_queued = False
        self.handles = [p.register_post_accumulate_grad_hook(partial(self._arrived, i))
                        for i, (_, p) in enumerate(self.named)]

    def _arrived(self, i: int, param: torch.Tensor) -> None:
        """Parameter ``i``'s 16-bit gradient is complete: taken from it, and its bucket moved onto the
        masters once the bucket's gradients are all here (none when a fused kernel added it to
        ``main_grad`` itself)."""
        grad, param.grad = param.grad, None
        if grad is None:
            return
        if not self._flush_queued:  # what is still waiting moves as this backward ends
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self._flush_queued = True
        bucket = self._bucket_of[i]
        waiting = self._waiting.setdefault(bucket, {})
        if i in waiting:  # a second gradient in one backward (reentrant checkpointing): straight on
            self.masters[i].grad.add_(grad)
            return
        waiting[i] = grad
        self.held += grad.nbytes
        if len(waiting) == len(self.buckets[bucket]):
            self._move(bucket)
        while self.held > self._most_held:  # the longest waiting first, one gradient at a time
            self._move(next(iter(self._waiting)))

    def _move(self, bucket: int) -> None:
        waiting, span = self._waiting.pop(bucket), self.buckets[bucket]
        self.held -= sum(grad.nbytes for grad in waiting.values())
        if len(waiting) == len(span) > 1:  # the whole bucket: one concatenation, one add
            flat = torch.cat([waiting[i].reshape(-1) for i in span])
            self.grad[self.offsets[span.start]:self.offsets[span.stop]].add_(flat)
        else:
            for i, grad in waiting.items():
                self.masters[i].grad.add_(grad)

    def flush(self) -> None:
        """The gradients still waiting (buckets some of whose parameters got none from autograd) onto
        their masters; run as each backward ends."""
        for bucket in list(self._waiting):
            self._move(bucket)
        self._flush_queued = False

    @torch.no_grad()
    def write_back(self) -> None:
        """The masters, after an optimizer step, into the 16-bit weights: one multi-tensor copy (a few
        kernel launches on a GPU instead of one per parameter, 290 for a Qwen2.5-0.5B)."""
        if self.named:  # (none when every trainable parameter is float32: LoRA's adapters, as PEFT makes them)
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


def _buckets(sizes: list[int], limit: int) -> list[range]:
    """Consecutive parameters grouped up to ``limit`` bytes (a larger one alone; 0: each alone)."""
    buckets: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > limit:
            buckets.append(range(start, i))
            start, total = i, 0
        total += size
    if sizes:
        buckets.append(range(start, len(sizes)))
    return buckets
