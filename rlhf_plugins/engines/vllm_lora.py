"""A LoRA adapter in the module names vLLM's model takes it under.

PEFT names an adapter's weights after transformers' modules. Where transformers fuses two projections
into one module and vLLM's model of the same architecture takes an adapter for each part (GLM and GLM-4:
transformers' MLP has one ``gate_up_proj``, vLLM's packed ``gate_up_proj`` wants ``gate_proj`` and
``up_proj`` adapters; vLLM refuses the fused name), the fused module's adapter is split: each part keeps
the same ``lora_A`` (the input side is shared) and takes its rows of ``lora_B`` -- so ``B_part A`` is
exactly the fused update's rows for that part. Where both fuse alike (Phi-3) nothing changes.
"""
from __future__ import annotations

from typing import Any

import torch

from ..errors import UsageError

#: fused transformers modules whose parts are of equal width, in the order transformers concatenates
#: them (a gated MLP: ``gate, up = gate_up_proj(x).chunk(2, -1)``)
EQUAL_PARTS = {"gate_up_proj": ("gate_proj", "up_proj")}


def split_parts(model_config: Any) -> dict[str, tuple[str, ...]]:
    """The packed modules of the model vLLM serves whose parts take adapters of their own (fused module
    name -> its parts), from the model class's ``packed_modules_mapping``."""
    from vllm.model_executor.models import ModelRegistry

    cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config=model_config)
    mapping = getattr(cls, "packed_modules_mapping", None) or {}
    return {fused: tuple(parts) for fused, parts in mapping.items() if list(parts) != [fused]}


def split_fused(weights: dict[str, torch.Tensor], config: dict[str, Any],
                parts: dict[str, tuple[str, ...]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``weights`` (PEFT's ``...<module>.lora_A.weight`` / ``lora_B.weight``) and the adapter's config
    with every adapter on a module vLLM wants in ``parts`` split into one adapter per part."""
    out: dict[str, torch.Tensor] = {}
    split: set[str] = set()
    for name, tensor in weights.items():
        module, sep, side = name.partition(".lora_")
        leaf = module.rsplit(".", 1)[-1]
        if not sep or leaf not in parts:
            out[name] = tensor
            continue
        if EQUAL_PARTS.get(leaf) != parts[leaf]:
            raise UsageError(f"vLLM takes the LoRA adapter of '{leaf}' as {', '.join(parts[leaf])}, a split this "
                             f"package cannot make; drop {leaf} from --lora.target_modules, or drop --sync.method "
                             "adapter (the merged weights sync instead)")
        n = len(parts[leaf])  # the input side copied (a file holds no tensor twice), the output side's rows
        pieces = [tensor.clone() for _ in range(n)] if side.startswith("A") else tensor.chunk(n, dim=0)
        for part, piece in zip(parts[leaf], pieces):
            out[f"{module[: len(module) - len(leaf)]}{part}{sep}{side}"] = piece
        split.add(leaf)
    targets = config.get("target_modules")
    if split and isinstance(targets, (list, tuple, set)):
        targets = sorted({p for t in targets for p in (parts[t] if t in split else (t,))})
        config = {**config, "target_modules": targets}
    return out, config


#: the LoRA ranks a vLLM engine can be started for (vLLM's ``MaxLoRARanks``)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_rank(want: int) -> int:
    """The smallest rank vLLM starts a LoRA engine for that holds ``want``."""
    return next((rank for rank in LORA_RANKS if rank >= want), want)


def lora_rank_bound(config: Any) -> int:
    """The engine's ``max_lora_rank``: ``--vllm.max_lora_rank`` raised to the run's own adapter rank (as
    OpenRLHF starts its engines with the run's ``--lora_rank``), rounded up to a rank vLLM accepts."""
    from ..builtin_plugins.lora import enabled, lora_config

    want = int(config.section("vllm").max_lora_rank)
    if enabled(config):
        want = max(want, int(lora_config(config).r))
    return vllm_rank(want)


def check_adapter(adapter: dict[str, Any]) -> None:
    """vLLM's own check of a PEFT LoRA config (its adapter_config.json as a dict) before vLLM is given it:
    no DoRA, trained biases, modules_to_save, PiSSA-like initialisations... One line where vLLM raises."""
    from types import SimpleNamespace

    from vllm.lora.peft_helper import PEFTHelper

    from ..errors import UsageError

    try:  # the rank is the engine's max_lora_rank, raised to the adapter's own (lora_rank_bound, fit_lora_rank)
        PEFTHelper.from_dict(adapter).validate_legal(SimpleNamespace(max_lora_rank=1 << 30))
    except ValueError as exc:
        raise UsageError(f"vLLM cannot load this LoRA adapter ({str(exc).rstrip('.')}); train with merged weights "
                         "instead (drop --sync.method adapter), or evaluate it with --generation.backend "
                         "transformers") from None


def check_run_adapter(config: Any) -> None:
    """:func:`check_adapter` of the run's LoRA config, as an engine for adapter sync starts (not at the
    first sync, after a step)."""
    from ..builtin_plugins.lora import enabled, lora_config
    from ..models.lora import config_dict

    if enabled(config):
        check_adapter(config_dict(lora_config(config)))
