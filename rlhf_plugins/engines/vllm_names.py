"""The names a vLLM engine loads synced weights under: its checkpoint's.

Learners send tensors under transformers' in-memory names. transformers 5 renames and fuses some
checkpoint tensors when it loads a model (its ``conversion_mapping``): a mixture of experts'
per-expert projections become one ``experts.gate_up_proj`` and one ``experts.down_proj`` per layer,
Mixtral's ``block_sparse_moe`` becomes ``mlp``, PhiMoE's ``gate`` a ``router``. vLLM's loaders are
written for checkpoints: some take the fused tensors too (Qwen3-MoE, OLMoE), some reject them
(Mixtral: "no module named 'layers.0.mlp'"; DeepSeek-V2: a KeyError) and some take them and load
them wrongly (Qwen2-MoE: log-probs off by 0.5 after one sync).

:class:`CheckpointNames` gives the loader what the checkpoint holds -- what vLLM loaded at its start:
a name the checkpoint has passes as it is; any other goes through transformers' own reverse of its
conversion (the one ``save_pretrained`` applies): views of the sent tensors where it splits along
their first dimension, a copy where the halves are not contiguous (the gate and up halves of a
layer's fused experts), made as vLLM's loader reaches them -- one layer's at a time.
A reverse that joins several sent tensors into one (transformers splits a few vision models' fused
tensors on load) needs them in the same part of a sync; text models' conversions only fuse.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..models.weights import checkpoint_shapes, meta_model


class CheckpointNames:
    """Turns a sync's (name, tensor) pairs into the checkpoint's, in the order they came."""

    def __init__(self, path: str, trust_remote_code: bool = False) -> None:
        self.path, self.trust_remote_code = path, trust_remote_code
        self.known = set(checkpoint_shapes(path))
        self._model: torch.nn.Module | None = None  # transformers' model on meta: its conversion mapping

    def __call__(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Lazily, as vLLM's loader takes them: a run of names outside the checkpoint is turned when
        the next checkpoint name (or the end) comes, so one layer's run is held at a time."""
        pending: dict[str, torch.Tensor] = {}
        for name, tensor in named:
            if name in self.known:
                yield from self._revert(pending)
                pending = {}
                yield name, tensor
            else:
                pending[name] = tensor
        yield from self._revert(pending)

    def _revert(self, pending: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        if not pending:
            return []
        from transformers.core_model_loading import revert_weight_conversion

        if self._model is None:
            self._model = meta_model(self.path, self.trust_remote_code)
        return list(revert_weight_conversion(self._model, pending).items())


def checkpoint_names(worker: Any) -> CheckpointNames:
    """The converter of a vLLM worker's model (made once per worker)."""
    state = worker.state
    if "checkpoint_names" not in state:
        config = worker.worker.vllm_config.model_config
        state["checkpoint_names"] = CheckpointNames(str(config.model), bool(config.trust_remote_code))
    return state["checkpoint_names"]
