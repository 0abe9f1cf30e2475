"""Decode steps of one fixed shape, replayed as a CUDA graph on GPUs.

A decode step of a small model on a GPU is bound by launching its kernels, not by computing them
(Qwen2.5-0.5B, 64 sequences, H200: about 20 ms a token in eager PyTorch, a few hundred kernels of
microseconds each). Here every step has the same shapes and the same tensors: the KV cache hands
attention its whole reserved storage and writes each step's keys at a position held in a device
tensor (:func:`rlhf_plugins.models.kv_cache.fix_shapes`), a boolean mask says which positions a step
may read, and the token and position ids are copied into fixed input buffers. So the step is
captured once per generation call as a CUDA graph and replayed: one launch per token. Sampling, the
stop check and the mask update stay outside the graph (a few kernels each).

Without a GPU (or with ``generation.cuda_graphs false``) the same fixed-shape step runs eagerly,
which is how its equality with the growing-cache decode is tested on CPUs.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..models.hf_names import cache_argument
from ..models.kv_cache import fix_shapes

logger = logging.getLogger("rlhf_plugins")


class StaticDecode:
    """The decode steps of one generation call: ``step(tokens, t)`` feeds the ``t``-th sampled token
    of every sequence and returns the next logits (``[B, vocab]``).

    ``mask``: ``[B, P + budget]``, 1 on the prompts' real tokens; ``next_pos``: ``[B, 1]`` position
    ids of the first decoded token; ``shared``: the cache is the shared-prefix one (its own part
    holds the decoded tokens from position 0), else the reserved one (decoded tokens from ``P``)."""

    def __init__(self, model: Any, cache: Any, mask: torch.Tensor, next_pos: torch.Tensor, budget: int,
                 shared: bool, graph: bool) -> None:
        self.model, self.cache, self.shared = model, cache, shared
        self.cache_argument = cache_argument(model, cache)  # the same cache every step
        B, width = mask.shape
        self.prompt_width = width - budget
        self.tokens = torch.zeros((B, 1), dtype=torch.long, device=mask.device)
        self.positions = next_pos.clone()
        self.write_at = torch.zeros(1, dtype=torch.long, device=mask.device)
        #: which key positions a step may read: the prompts' real tokens, then each decoded one
        self.readable = mask.bool().clone()
        self.readable[:, self.prompt_width:] = False
        self.mask = self.readable[:, None, None, :]
        fix_shapes(cache, self.write_at, 0 if shared else self.prompt_width)
        if shared:
            cache.own_mask = self.readable[:, self.prompt_width:]
        self.use_graph = graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.tokens, attention_mask=self.mask, position_ids=self.positions,
                         use_cache=True, **self.cache_argument,
                         **({"shared_prefix": self.cache} if self.shared else {}))
        return out.logits[:, -1, :]

    def step(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        column = self.prompt_width + t
        self.tokens.copy_(tokens[:, None])
        self.write_at.fill_(t if self.shared else column)
        self.readable[:, column] = True
        if self.use_graph and self.graph is None:
            self.graph = self._capture()
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self._forward()
        self.positions.add_(1)
        return logits

    def _capture(self) -> torch.cuda.CUDAGraph | None:
        """Record one step (after a warm-up on a side stream, which computes this very step, so
        its writes are the ones the replay then repeats); None, with one line, if the model's forward
        cannot be captured (it synchronises with the host somewhere): the steps then run eagerly."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.logits = self._forward()
        except Exception as exc:  # noqa: BLE001 - any capture failure: decode eagerly instead
            torch.cuda.synchronize()
            self.use_graph = False
            logger.warning("decode steps of %s cannot be captured as a CUDA graph (%s); they run eagerly",
                           type(self.model).__name__, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return None
        return graph
