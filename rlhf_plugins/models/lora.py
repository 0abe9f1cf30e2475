"""LoRA weights by name: PEFT's parameter names, the merged export an engine loads, the adapter
alone as PEFT saves it. Used by learners (what to send), engines (what they receive) and the
LoRA plugin; no PEFT import at module level."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

_PREFIX = "base_model.model."


def is_lora_name(name: str) -> bool:
    return ".lora_" in name or name.startswith("lora_")


def base_name(name: str) -> str:
    """PEFT's parameter name -> the base model's (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``;
    nested wrappers of one module's parameters: ``experts.base_layer.base_layer.down_proj`` ->
    ``experts.down_proj``)."""
    while ".base_layer." in name:
        name = name.replace(".base_layer.", ".")
    return name.replace(_PREFIX, "", 1) if name.startswith(_PREFIX) or f".{_PREFIX}" in name else name


#: a LoRA on a parameter: the adapted tensor's base name -> (the wrapper module's name, experts, in/out swapped)
ParamWrappers = dict[str, tuple[str, int, bool]]


def param_wrappers(model: Any) -> ParamWrappers:
    """PEFT's LoRA on parameters rather than linear modules (``ParamWrapper``): "all-linear" on a
    transformers mixture of experts adapts each layer's fused 3-D expert tensors, one low-rank pair
    per expert, the wrappers nested when one module has two such tensors."""
    return {base_name(f"{path}.{module.parameter_name}"): (path, int(module.num_experts),
                                                            bool(module._did_swap_in_out_features))
            for path, module in model.named_modules()
            if getattr(module, "parameter_name", None) and hasattr(module, "lora_A")}


def transposed_modules(model: Any) -> frozenset[str]:
    """LoRA modules whose base weight is stored in x out (GPT-2's ``Conv1D``; PEFT's ``fan_in_fan_out``),
    by base name: their ``B @ A`` is folded in transposed."""
    return frozenset(base_name(path) for path, module in model.named_modules()
                     if hasattr(module, "lora_A") and getattr(module, "fan_in_fan_out", False))


def _expert_delta(a: Any, b: Any, experts: int, swapped: bool) -> Any:
    """Each expert's ``B_e @ A_e`` of a parameter LoRA (A: experts*r x in, B: out x experts*r), laid
    out as the parameter is: experts x out x in when swapped, else experts x in x out."""
    import torch

    if experts == 1:  # a plain 2-D parameter (a router's weight): as a linear layer's
        return b @ a
    a = a.reshape(experts, -1, a.shape[-1])
    b = b.reshape(b.shape[0], -1, experts)
    return torch.einsum("ore,eri->eoi" if swapped else "ore,eri->eio", b, a)


def merged_weights(named: Iterable[tuple[str, Any]], scaling: float, wrappers: ParamWrappers | None = None,
                   transposed: frozenset[str] = frozenset()) -> Iterator[tuple[str, Any]]:
    """Base-model weights with every LoRA pair folded in: ``W + scaling * B @ A`` (per expert for a
    parameter LoRA, ``wrappers``; ``(B @ A)^T`` for the in x out weights of ``transposed`` modules)."""
    tensors = dict(named)
    lora_a = {n.split(".lora_A.")[0]: t for n, t in tensors.items() if ".lora_A." in n}
    lora_b = {n.split(".lora_B.")[0]: t for n, t in tensors.items() if ".lora_B." in n}
    for name, tensor in tensors.items():
        if is_lora_name(name):
            continue
        base = base_name(name)
        module = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if module is not None and module in lora_a and name.endswith(".weight"):
            delta = lora_b[module].to(tensor.dtype) @ lora_a[module].to(tensor.dtype)
            tensor = tensor + scaling * (delta.T if base_name(module) in transposed else delta)
        elif wrappers and base in wrappers:
            path, experts, swapped = wrappers[base]
            delta = _expert_delta(lora_a[path].to(tensor.dtype), lora_b[path].to(tensor.dtype), experts, swapped)
            tensor = tensor + scaling * delta
        yield base, tensor


def adapter_weights(named: Iterable[tuple[str, Any]], adapter: str = "default") -> dict[str, Any]:
    """LoRA tensors under the names PEFT saves (adapter name dropped)."""
    return {n.replace(f".{adapter}.", "."): t for n, t in named if is_lora_name(n)}


def peft_info(model: Any) -> tuple[Any, float] | None:
    """(the PEFT config, its scaling) when ``model`` (or a critic's backbone) is a PeftModel."""
    target = getattr(model, "backbone", model)
    peft_config = getattr(target, "peft_config", None)
    if not peft_config:
        return None
    cfg = peft_config["default"]
    scaling = cfg.lora_alpha / (cfg.r ** 0.5 if getattr(cfg, "use_rslora", False) else cfg.r)
    return cfg, scaling


def config_dict(cfg: Any) -> dict[str, Any]:
    data = cfg.to_dict()
    for key, value in list(data.items()):
        if isinstance(value, set):
            data[key] = sorted(value)
    return data


def export_weights(model: Any, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """What a generation engine loads: LoRA merged in under base names, else the weights as they are."""
    info = peft_info(model)
    if info is None:
        yield from named
    else:
        yield from merged_weights(named, info[1], param_wrappers(model), transposed_modules(model))


def lora_config_from_dict(data: dict[str, Any]) -> Any:
    from peft import LoraConfig

    known = set(LoraConfig.__dataclass_fields__) - {"peft_type"}
    return LoraConfig(**{k: v for k, v in data.items() if k in known})
