"""Loads that vLLM's in-place reload does not see, made to land.

vLLM's reload (``initialize_layerwise_reload``) puts every layer's parameters on the meta device and
wraps their ``weight_loader`` to collect what arrives; a layer is rebuilt once all of it came. Some
architectures' ``load_weights`` copy into a parameter themselves instead of through its loader
(vLLM 0.32's gpt-oss: attention sinks, the experts' weights and biases): during a reload those
copies land in the meta placeholder and are lost, the layer "fails to load" (a warning vLLM logs and
carries on), and the engine keeps sampling with the old experts -- log-probs off by 0.3 after one
step of training, with no error.

:class:`DirectCopies` is active while a sync's tensors load: a copy into a parameter waiting on the
meta device (outside vLLM's own counting of its loaders) takes that layer out of the reload -- its
kernel tensors go back in place -- and lands in them; the layer is processed again when the sync
ends (:func:`process_taken`), as a reload would have.

A layer taken out is whole: the layer's loads must all be direct copies. One that gets some of its
tensors through its loaders as well (before the take-out vLLM buffered them, after it vLLM drops them
as "excessive loading") would keep stale weights, so such a sync stops with a
:class:`~rlhf_plugins.models.weights.WeightSyncError` naming the layer and both kinds of tensor.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..models.weights import WeightSyncError

#: ``Tensor.data``'s descriptor (``param.data.copy_(...)`` reaches a parameter through it)
_DATA = torch._C.TensorBase.__dict__["data"]


def _counting() -> bool:
    """Whether vLLM is counting a loader's copies into meta tensors (its own reload bookkeeping)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(type(mode).__name__ == "CopyCounter" for mode in _get_current_dispatch_mode_stack())


class DirectCopies(TorchFunctionMode):
    """While active: copies into the meta placeholders of ``model``'s reloading layers land in the
    layers' kernel tensors instead (see the module's text); ``taken`` lists the layers taken out."""

    def __init__(self, model: torch.nn.Module, taken: list[torch.nn.Module]) -> None:
        super().__init__()
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        self.taken = taken
        #: id of a meta placeholder (or of its ``.data``) -> (layer, parameter name)
        self.owner: dict[int, tuple[torch.nn.Module, str]] = {}
        #: reloading layer -> its qualified name and its meta placeholders by parameter name
        self.layers: dict[torch.nn.Module, tuple[str, dict[str, torch.nn.Parameter]]] = {}
        self._keep: list[torch.Tensor] = []  # the ``.data`` aliases, alive while their ids are keys
        for qualified, layer in model.named_modules():
            info = LAYERWISE_INFO.get(layer)
            if info is None or not info.can_load():
                continue
            for name, param in layer._parameters.items():
                if param is not None and param.is_meta:
                    self.owner[id(param)] = (layer, name)
                    self.layers.setdefault(layer, (qualified, {}))[1][name] = param

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not args or id(args[0]) not in self.owner or _counting():
            return out
        if getattr(func, "__self__", None) is _DATA:  # param.data: the same placeholder by another name
            self.owner[id(out)] = self.owner[id(args[0])]
            self._keep.append(out)
        elif func is torch.Tensor.copy_:
            layer, name = self.owner[id(args[0])]
            self._take_out(layer, name)
            with torch.no_grad():
                getattr(layer, name).data.copy_(args[1])
        return out

    def _take_out(self, layer: torch.nn.Module, copied: str) -> None:
        """Put ``layer``'s kernel tensors back and end its part in the reload (once); from then on a
        load through one of its loaders stops the sync (it would be lost)."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _place_kernel_tensors

        if any(t is layer for t in self.taken):
            return
        info = LAYERWISE_INFO[layer]
        qualified, placeholders = self.layers[layer]
        if info.loaded_weights:
            raise WeightSyncError(_mixed(qualified, layer, sorted({n for n, _ in info.loaded_weights}), copied))
        _place_kernel_tensors(layer, info)
        info.reset()
        self.taken.append(layer)
        for name, param in [*placeholders.items(), *layer.named_parameters(recurse=False)]:
            refusal = _mixed(qualified, layer, [name], copied)
            param.weight_loader = _Refusing(getattr(param, "weight_loader", None), refusal)


def _mixed(qualified: str, layer: torch.nn.Module, loaded: list[str], copied: str) -> str:
    return (f"weight sync: vLLM's reload of layer '{qualified}' ({type(layer).__name__}) gets {', '.join(loaded)} "
            f"through its weight loaders and {copied} by a direct copy; one reload cannot land both, and the engine "
            "would keep stale weights -- rlhf-plugins' vLLM reload (engines/vllm_reload.py) does not support this "
            "architecture yet: generate with --generation.backend transformers meanwhile")


class _Refusing:
    """The weight loader of a parameter of a layer taken out of the reload: a load through it would
    be lost (see the module's text), so it stops the sync; ``original`` is put back afterwards."""

    __name__ = "refusing_loader"  # vLLM reads a loader's name to tell its own wrapper from others

    def __init__(self, original: Any, message: str) -> None:
        self.original, self.message = original, message

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise WeightSyncError(self.message)


def _restore_loaders(layer: torch.nn.Module) -> None:
    """Give ``layer``'s tensors their own loaders back: its kernel tensors and its meta placeholders
    (vLLM keeps those and registers them again at the next reload)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(layer)
    placeholders = list(info.restore_metadata[0].values()) if info is not None else []
    for param in [*layer.parameters(recurse=False), *placeholders]:
        loader = getattr(param, "weight_loader", None)
        if isinstance(loader, _Refusing):
            if loader.original is None:
                del param.weight_loader
            else:
                param.weight_loader = loader.original


def process_taken(taken: list[torch.nn.Module]) -> int:
    """Process the layers taken out of a reload as vLLM processes loaded weights (an expert layer's
    kernel packs them again). Returns how many had processing to do."""
    done = 0
    for layer in taken:
        _restore_loaders(layer)
        process = getattr(getattr(layer, "quant_method", None), "process_weights_after_loading", None)
        if callable(process):
            with torch.no_grad():
                process(layer)
            done += 1
    taken.clear()
    return done
