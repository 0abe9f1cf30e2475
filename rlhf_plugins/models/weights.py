"""Copying named weights into a model: name mapping, dtype conversion, loud mismatches."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..errors import UsageError
from .empty_init import point_at


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """The names under which a parameter appears a second time (an output head tied to the embedding):
    one tensor, given once, under its first name, to syncs and exports."""
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return every - {name for name, _ in model.named_parameters()}


def meta_model(path: str, trust_remote_code: bool = False) -> torch.nn.Module:
    """transformers' model of the folder at ``path`` on the meta device (only its config is read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def transformers_shapes(path: str, trust_remote_code: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of the tensors transformers holds for the model at ``path`` (built on
    the meta device: only its config is read), the names a learner of that model sends. They differ
    from the checkpoint's where transformers fuses tensors on load: a mixture of experts' per-expert
    projections become one ``experts.gate_up_proj`` and one ``experts.down_proj`` per layer. A tied
    tensor is named once, as learners send it."""
    model = meta_model(path, trust_remote_code)
    aliases = tied_aliases(model)
    return {name: (tuple(t.shape), str(t.dtype)) for name, t in model.state_dict().items() if name not in aliases}


_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64", "I32": "int32"}


def checkpoint_shapes(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of the tensors in the safetensors files of the folder at ``path`` (their
    headers only)."""
    from pathlib import Path

    from safetensors import safe_open

    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), str(getattr(torch, _DTYPES.get(sl.get_dtype(), "float32"))))
    return out


class WeightSyncError(UsageError):
    """Weights that do not fit the receiving model (names, shapes)."""


def load_named_weights(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]],
                       materialize_on: torch.device | None = None, mix: float | None = None,
                       receiver: str = "the engine's model") -> dict[str, Any]:
    """Copy tensors into ``model`` in place by state-dict name, converting dtype; a parameter still on
    the meta device (a model built empty) first gets storage on ``materialize_on``. With ``mix``
    (alpha), move each towards the given tensor instead: ``alpha x given + (1 - alpha) x own``.

    Every name must exist with the same shape; the error lists the first few
    offenders so a wrong name mapping is found at the first sync, not later.
    """
    params = dict(model.state_dict(keep_vars=True))
    unknown, bad_shape = [], []
    count = nbytes = 0
    with torch.no_grad():
        for name, tensor in named:
            target = params.get(name)
            if target is None:
                unknown.append(name)
                continue
            if tuple(target.shape) != tuple(tensor.shape):
                bad_shape.append(f"{name} {tuple(tensor.shape)} != {tuple(target.shape)}")
                continue
            if target.dtype != tensor.dtype and not (target.is_floating_point() and tensor.is_floating_point()):
                bad_shape.append(f"{name} {tensor.dtype} cannot become {target.dtype}")
                continue
            if target.is_meta and materialize_on is not None:
                point_at(target, torch.empty(target.shape, dtype=target.dtype, device=materialize_on))
            given = tensor.to(dtype=target.dtype, device=target.device)
            if mix is None:
                target.data.copy_(given)
            else:
                target.data.lerp_(given, mix)
            count += 1
            nbytes += tensor.numel() * tensor.element_size()
    if unknown or bad_shape:
        parts = []
        if unknown:
            parts.append(f"unknown names {unknown[:3]}{' ...' if len(unknown) > 3 else ''}")
        if bad_shape:
            parts.append(f"shape mismatches {bad_shape[:3]}")
        raise WeightSyncError(f"weight sync does not fit {receiver}: " + "; ".join(parts))
    return {"tensors": count, "bytes": nbytes}
