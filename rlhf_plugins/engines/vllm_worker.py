"""A vLLM worker (the process holding the model, or one tensor-parallel shard of it) as a
:class:`rlhf_plugins.ModelWorker`, the view of it that weight-sync methods use.

Weights load through vLLM's in-place reload, which moves each layer's kernel tensors aside, collects
the layer's checkpoint tensors (q, k and v become one fused tensor; CPU kernels repack), and
processes the layer once all of them are there. ``load_weights_part`` opens a reload at the first
part of a sync and feeds each part in as it arrives (a layer may straddle two parts: vLLM keeps its
first half until the rest comes), and ``finish_weights`` closes it -- so a bucketed sync holds about
two buckets and one layer, never a second copy of the model; ``load_weights`` is both at once.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .vllm_names import checkpoint_names
from .vllm_reload import DirectCopies, process_taken

READING = "vllm_reload_open"
#: the layers a sync's loads took out of vLLM's reload (:mod:`.vllm_reload`)
TAKEN = "vllm_reload_taken"


class VLLMModelWorker:
    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.rank = int(getattr(worker, "rank", 0))
        self.state = worker.__dict__.setdefault("_rlhf_state", {})

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        moved = self.load_weights_part(named)
        self.finish_weights()
        return moved

    def load_weights_part(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        named = list(named)
        model = self.worker.model_runner.get_model()
        with set_current_vllm_config(self.worker.vllm_config), torch.no_grad():
            if not self.state.get(READING):
                repack_experts_on_reload(model)
                initialize_layerwise_reload(model)
                self.state[READING] = True
            with DirectCopies(model, self.state.setdefault(TAKEN, [])):
                model.load_weights(checkpoint_names(self)(named))
        return _moved(named)

    def finish_weights(self) -> dict[str, Any]:
        """Process what is left (layers vLLM defers, e.g. attention) and drop state derived from the
        old weights, as vLLM's own ``reload_weights`` does after loading."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        if not self.state.pop(READING, False):
            return {}
        runner = self.worker.model_runner
        with set_current_vllm_config(self.worker.vllm_config), torch.no_grad():
            finalize_layerwise_reload(runner.get_model(), self.worker.vllm_config.model_config)
            process_taken(self.state.pop(TAKEN, []))
        refresh_tied(runner.get_model())
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            getattr(runner, reset, lambda: None)()
        return {}


def refresh_tied(model: torch.nn.Module) -> int:
    """Re-derive what modules sharing a weight computed from it. A tied output head is its own module
    holding the embedding's parameter; a reload loads the embedding (the checkpoint has no head) and
    leaves the head alone, so what the head derived from the weight at start -- vLLM's CPU build packs
    it for its matrix kernels -- stays the checkpoint's, and every sync after the first left the head
    behind (a model with tied embeddings sampled with its initial output head). The first module
    holding a weight is the one its name belongs to (the one loaded); the others are refreshed.
    Returns how many were."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    done = 0
    for modules in owners.values():
        for module in modules[1:]:
            process = getattr(getattr(module, "quant_method", None), "process_weights_after_loading", None)
            if callable(process):
                with torch.no_grad():
                    process(module)
                done += 1
    return done


def repack_experts_on_reload(model: torch.nn.Module) -> int:
    """Make a reload repack mixture-of-experts weights for vLLM's CPU expert kernel.

    vLLM (0.32) packs a layer's expert weights into its CPU kernel's layout
    (``CPUUnquantizedExperts.process_weights_after_loading``) only when the weights are first
    processed; a reload processes the layer again but skips that step as a "weight update" and leaves
    the new weights in the checkpoint's layout, which the kernel then reads as packed: after the first
    sync an MoE model samples from scrambled experts (log-probs off by 0.1 on the reduced
    Qwen3-30B-A3B shape, with no error). Each such layer's processing is wrapped to run the pack when
    vLLM's own processing did not. Returns how many layers were wrapped (once per layer)."""
    wrapped = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is None or "CPUUnquantizedExperts" not in {k.__name__ for k in type(experts).__mro__}:
            continue
        if getattr(method, "_rlhf_repacks", False):
            continue
        method.process_weights_after_loading = _packing(method.process_weights_after_loading, experts)
        method._rlhf_repacks = True
        wrapped += 1
    return wrapped


def _packing(process: Any, experts: Any) -> Any:
    """``process`` (a layer's weight processing), followed by the expert kernel's pack unless
    ``process`` ran it itself (a later vLLM that packs on updates is left alone)."""
    pack = experts.process_weights_after_loading

    def process_and_pack(layer: torch.nn.Module) -> None:
        ran: list[bool] = []

        def flagged_pack(lay: torch.nn.Module) -> None:
            ran.append(True)
            pack(lay)

        experts.process_weights_after_loading = flagged_pack
        try:
            process(layer)
        finally:
            del experts.process_weights_after_loading  # the class's method again
        if not ran:
            pack(layer)
    return process_and_pack


def _moved(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    return {"tensors": len(named), "bytes": sum(t.numel() * t.element_size() for _, t in named)}


def reclass_model(worker: VLLMModelWorker, moved: dict[type, type]) -> int:
    """Give the worker's model the classes vLLM patched (:mod:`.vllm_classes`)."""
    from .vllm_classes import reclass

    return reclass(worker.worker.model_runner.get_model(), moved)


def on_worker(worker: Any, fn: Any, *args: Any) -> Any:  # pragma: no cover - runs in vLLM's workers
    return fn(VLLMModelWorker(worker), *args)


def load(worker: VLLMModelWorker, named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    return worker.load_weights(named)
