"""LoRA weights by name: PEFT's parameter names, the merged export an engine loads, the adapter
alone as PEFT saves it. Used by learners (what to send), engines (what they receive) and the
LoRA plugin; no PEFT import at module level."""
from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

_PREFIX = "base_model.model."
#: the adapter a run trains (PEFT's default name)
ADAPTER = "default"


@contextmanager
def quiet_peft_wrapping() -> Iterator[None]:
    """PEFT's per-layer notes while it wraps a model that this project already handles: GPT-2's Conv1D
    layers get its fan_in_fan_out (merged weights follow it: :func:`adapted_layers`), and a tied head or
    embedding in the adapter (refused where it matters, merged weights: ``builtin_plugins/lora``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to")
        warnings.filterwarnings("ignore", message="Model has `tie_word_embeddings=True`")
        warnings.filterwarnings("ignore", message="Model with `tie_word_embeddings=True`")  # where it names them
        yield


def is_lora_name(name: str) -> bool:
    return ".lora_" in name or name.startswith("lora_")


def base_name(name: str) -> str:
    """PEFT's parameter name -> the base model's (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``;
    nested wrappers of one module's parameters: ``experts.base_layer.base_layer.down_proj`` ->
    ``experts.down_proj``)."""
    while ".base_layer." in name:
        name = name.replace(".base_layer.", ".")
    return name.replace(_PREFIX, "", 1) if name.startswith(_PREFIX) or f".{_PREFIX}" in name else name


class Wrapped(NamedTuple):
    """A LoRA on a parameter: the wrapper module's name, its experts, in/out swapped, its scale."""
    path: str
    experts: int
    swapped: bool
    scaling: float


#: a LoRA on a parameter, by the adapted tensor's base name
ParamWrappers = dict[str, Wrapped]


def param_wrappers(model: Any) -> ParamWrappers:
    """PEFT's LoRA on parameters rather than linear modules (``ParamWrapper``): "all-linear" on a
    transformers mixture of experts adapts each layer's fused 3-D expert tensors, one low-rank pair
    per expert, the wrappers nested when one module has two such tensors."""
    return {base_name(f"{path}.{module.parameter_name}"): Wrapped(
                path, int(module.num_experts), bool(module._did_swap_in_out_features), float(module.scaling[ADAPTER]))
            for path, module in model.named_modules()
            if getattr(module, "parameter_name", None) and hasattr(module, "lora_A")}


@dataclass(frozen=True)
class Adapted:
    """How one LoRA layer's ``B @ A`` (out x in) folds into the tensor it adapts."""
    scaling: float  #: the layer's own: alpha / r, rsLoRA's alpha / sqrt(r), rank_pattern / alpha_pattern's
    transposed: bool = False  #: the tensor is stored in x out (GPT-2's Conv1D, PEFT's fan_in_fan_out; embeddings)
    dora: bool = False  #: DoRA: each output's merged row rescaled to its learned magnitude


#: PEFT's LoRA variants whose merged weights are folded here (others, e.g. aLoRA, have no merged form)
FOLDED_VARIANTS = ("DoraLinearVariant", "DoraEmbeddingVariant")


def _refuse_unmergeable(name: str, module: Any, variant: Any) -> None:
    """One line for a LoRA layer whose merged weights the engine cannot be given."""
    from .weights import WeightSyncError

    if variant is not None and type(variant).__name__ not in FOLDED_VARIANTS:
        raise WeightSyncError(f"the LoRA of {name} is PEFT's {type(variant).__name__}, which is not merged into an "
                              "engine's weights here; use a plain or DoRA LoRA config")
    if (getattr(module, "lora_bias", None) or {}).get(ADAPTER) and module.get_base_layer().bias is None:
        raise WeightSyncError(f"the LoRA of {name} has a bias (lora_bias) and its layer has none, so it cannot be "
                              "merged into an engine's weights; use --sync.method adapter or lora_bias false")


def adapted_layers(model: Any) -> dict[str, Adapted]:
    """Every LoRA layer on a module (linear, Conv1D, embedding) of ``model``, by the module's base name;
    one that cannot be merged is refused in one line."""
    layers = {}
    for path, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if not (isinstance(scaling, dict) and ADAPTER in scaling) or getattr(module, "parameter_name", None):
            continue
        variant = (getattr(module, "lora_variant", None) or {}).get(ADAPTER)
        _refuse_unmergeable(base_name(path), module, variant)
        embedding = ADAPTER in (getattr(module, "lora_embedding_A", None) or {})
        # DoRA is PEFT's one variant folded here; older PEFT (0.15) has no variants and marks it in use_dora
        dora = variant is not None or bool((getattr(module, "use_dora", None) or {}).get(ADAPTER))
        layers[base_name(path)] = Adapted(float(scaling[ADAPTER]),
                                          embedding or bool(getattr(module, "fan_in_fan_out", False)), dora)
    return layers


#: a LoRA layer's tensors by what they are
_PARTS = {f".lora_A.{ADAPTER}.weight": "A", f".lora_B.{ADAPTER}.weight": "B", f".lora_B.{ADAPTER}.bias": "B.bias",
          f".lora_embedding_A.{ADAPTER}": "A", f".lora_embedding_B.{ADAPTER}": "B",
          f".lora_magnitude_vector.{ADAPTER}.weight": "magnitude"}


def _lora_parts(tensors: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The LoRA tensors of each adapted module (PEFT's module name): A, B, B's bias, DoRA's magnitudes."""
    parts: dict[str, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        for suffix, part in _PARTS.items():
            if name.endswith(suffix):
                parts.setdefault(name[: -len(suffix)], {})[part] = tensor
    return parts


def _expert_delta(a: Any, b: Any, experts: int, swapped: bool) -> Any:
    """Each expert's ``B_e @ A_e`` of a parameter LoRA (A: experts*r x in, B: out x experts*r), laid
    out as the parameter is: experts x out x in when swapped, else experts x in x out."""
    import torch

    if experts == 1:  # a plain 2-D parameter (a router's weight): as a linear layer's
        return b @ a
    a = a.reshape(experts, -1, a.shape[-1])
    b = b.reshape(b.shape[0], -1, experts)
    return torch.einsum("ore,eri->eoi" if swapped else "ore,eri->eio", b, a)


def _fold(tensor: Any, kind: str, parts: dict[str, Any], layer: Adapted) -> Any:
    """``tensor`` (the module's base ``weight`` or ``bias``) with its LoRA folded in, as PEFT merges it."""
    if kind == "bias":
        bias = parts.get("B.bias")  # PEFT's lora_bias
        return tensor if bias is None else tensor + layer.scaling * bias.to(tensor.dtype)
    if kind != "weight":
        return tensor
    rows = tensor.T if layer.transposed else tensor  # out x in
    merged = rows + layer.scaling * (parts["B"].to(tensor.dtype) @ parts["A"].to(tensor.dtype))
    if layer.dora:  # m * (W + s B A) / ||W + s B A||, each output's row
        merged = merged * (parts["magnitude"].to(tensor.dtype) / merged.norm(dim=1)).unsqueeze(1)
    return merged.T if layer.transposed else merged


def lora_groups(model: Any) -> dict[str, str]:
    """Each tensor of a LoRA-wrapped module (its base layer's, its LoRA pair's, DoRA's magnitudes) by that
    module's PEFT name: what must be at hand together to merge it (nested wrappers: the outermost)."""
    groups: dict[str, str] = {}
    for path, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and ADAPTER in scaling:
            for name, _ in module.named_parameters(prefix=path):
                groups.setdefault(name, path)
    return groups


def _by_module(named: Iterable[tuple[str, Any]], groups: dict[str, str]) -> Iterator[list[tuple[str, Any]]]:
    """``named`` in runs that merge alone: a LoRA module's tensors once all have arrived, any other
    tensor as it comes -- so a sharded learner's gathered model is never held whole (a run whose tensors
    do not come as ``groups`` says is still merged right, only held longer)."""
    sizes = Counter(groups.values())
    pending: dict[str, list[tuple[str, Any]]] = {}
    for name, tensor in named:
        group = groups.get(name)
        if group is None:
            yield [(name, tensor)]
            continue
        members = pending.setdefault(group, [])
        members.append((name, tensor))
        if len(members) == sizes[group]:
            yield pending.pop(group)
    yield from pending.values()


def merged_weights(named: Iterable[tuple[str, Any]], layers: dict[str, Adapted],
                   wrappers: ParamWrappers | None = None,
                   groups: dict[str, str] | None = None) -> Iterator[tuple[str, Any]]:
    """Base-model weights with every LoRA folded in (``W + s * B @ A`` per layer, its own scale and
    orientation, DoRA's rescaling; per expert for a parameter LoRA, ``wrappers``), PEFT's fully trained
    copies (``modules_to_save``) under the base names. With ``groups`` (:func:`lora_groups`) it streams:
    each module is merged once its tensors have arrived."""
    for run in _by_module(named, groups) if groups is not None else [list(named)]:
        yield from _merged_run(dict(run), layers, wrappers)


def _merged_run(tensors: dict[str, Any], layers: dict[str, Adapted],
                wrappers: ParamWrappers | None) -> Iterator[tuple[str, Any]]:
    parts = _lora_parts(tensors)
    for name, tensor in tensors.items():
        if is_lora_name(name) or ".original_module." in name:
            continue
        base = base_name(name.replace(f".modules_to_save.{ADAPTER}.", "."))
        module, _, kind = name.rpartition(".base_layer.")
        if module in parts and base_name(module) in layers:
            tensor = _fold(tensor, kind, parts[module], layers[base_name(module)])
        elif wrappers and base in wrappers:
            path, experts, swapped, scaling = wrappers[base]
            a, b = parts[path]["A"].to(tensor.dtype), parts[path]["B"].to(tensor.dtype)
            tensor = tensor + scaling * _expert_delta(a, b, experts, swapped)
        yield base, tensor


def adapter_weights(model: Any, named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """The adapter's tensors under the names PEFT saves them (``named``: the model's tensors, gathered
    where they are sharded): LoRA pairs, DoRA's magnitudes, trained biases and ``modules_to_save``
    copies -- what ``set_peft_model_state_dict`` and vLLM's adapter loader read."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=dict(named), adapter_name=ADAPTER,
                                     save_embedding_layers=False)


def lora_config_of(model: Any) -> Any | None:
    """The PEFT config of ``model`` (or of a critic's backbone) when it is a PeftModel."""
    peft_config = getattr(getattr(model, "backbone", model), "peft_config", None)
    return peft_config[ADAPTER] if peft_config else None


def config_dict(cfg: Any) -> dict[str, Any]:
    data = cfg.to_dict()
    for key, value in list(data.items()):
        if isinstance(value, set):
            data[key] = sorted(value)
    return data


def export_weights(model: Any, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """What a generation engine loads: LoRA merged in under base names, else the weights as they are."""
    if lora_config_of(model) is None:
        yield from named
    else:
        yield from merged_weights(named, adapted_layers(model), param_wrappers(model), lora_groups(model))


def lora_config_from_dict(data: dict[str, Any]) -> Any:
    from peft import LoraConfig

    known = set(LoraConfig.__dataclass_fields__) - {"peft_type"}
    return LoraConfig(**{k: v for k, v in data.items() if k in known})
