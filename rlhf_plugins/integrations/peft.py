"""PEFT integration: LoRA on the actor (and critic) by wrapping model loading.

``--lora.rank 8`` (or ``--lora.config adapter_config.json``) wraps whatever the
``rlhf_load_model`` hook loaded with PEFT, for the torch and DeepSpeed learners
alike. Two ways to bring LoRA weights to the generation engine:

* ``--lora.sync merged`` (default): the learner exports ``W + scale * B @ A`` under
  the base model's names, through whichever weight-sync method runs.
* ``--lora.sync adapter``: only the adapter moves (``--sync.method adapter``); vLLM
  generates with its LoRA support, the transformers engine wraps itself with PEFT.

Saving writes the adapter in PEFT's format; ``--lora.save_merged`` also writes the
merged model next to it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from .._markers import hookimpl
from ..errors import ConfigError
from ..types import WeightSyncMethod


@dataclass
class LoraOptions:
    #: LoRA rank; 0 disables LoRA
    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    #: module names (suffixes) to adapt, or "all-linear"
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    #: a PEFT ``adapter_config.json`` (or its folder) instead of the fields above
    config: str | None = None
    #: also put LoRA on the critic's backbone
    critic: bool = True
    #: how LoRA reaches the generation engine: merged full weights, or the adapter alone
    sync: Literal["merged", "adapter"] = "merged"
    #: after training, also save base + adapter merged into ``<run>/final-merged``
    save_merged: bool = False


def enabled(config: Any) -> bool:
    o = getattr(config, "extra", {}).get("lora")  # absent from a Config built without plugins
    return o is not None and (o.rank > 0 or o.config is not None)


def lora_config(config: Any) -> Any:
    from peft import LoraConfig

    o = config.section("lora")
    if o.config:
        path = Path(o.config)
        path = path / "adapter_config.json" if path.is_dir() else path
        return lora_config_from_dict(json.loads(path.read_text()))
    targets: Any = o.target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    return LoraConfig(r=o.rank, lora_alpha=o.alpha, lora_dropout=o.dropout, target_modules=targets, bias="none")


def linear_names(model: Any) -> list[str]:
    import torch

    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def apply_lora(model: Any, config: Any, role: str) -> Any:
    from peft import get_peft_model

    cfg = lora_config(config)
    target = model.backbone if role == "critic" else model
    try:
        wrapped = get_peft_model(target, cfg)
    except ValueError as exc:
        if "not found in the base model" in str(exc) or "Target modules" in str(exc):
            wanted = sorted(cfg.target_modules) if isinstance(cfg.target_modules, (set, list)) else cfg.target_modules
            raise ConfigError(
                f"LoRA target modules {wanted} match nothing in the {role} model; available: "
                + ", ".join(linear_names(target))
            ) from exc
        raise
    if role == "critic":
        model.backbone = wrapped
        return model
    return wrapped


@hookimpl
def rlhf_add_options(options: Any) -> None:
    options.add_section("lora", LoraOptions)


@hookimpl
def rlhf_configure(config: Any) -> None:
    if not enabled(config):
        return
    o = config.section("lora")
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConfigError("LoRA needs peft, which is not installed: pip install 'rlhf-plugins[peft]'")
    if o.rank < 0 or o.alpha <= 0 or not 0 <= o.dropout < 1:
        raise ConfigError("lora.rank must be >= 0, lora.alpha > 0 and lora.dropout in [0, 1)")
    if o.config and not Path(o.config).exists():
        raise ConfigError(f"lora.config '{o.config}' does not exist; give a PEFT adapter_config.json or its folder")
    if o.sync == "adapter":
        config.sync.method = "adapter"  # only the adapter travels
        if config.generation.backend == "vllm" and importlib.util.find_spec("vllm.lora.request") is None:
            raise ConfigError("this vLLM build has no LoRA support (vllm.lora), which adapter sync needs; "
                              "use --lora.sync merged")
    elif config.sync.method == "adapter":
        raise ConfigError("sync.method adapter needs --lora.sync adapter")


@hookimpl(wrapper=True)
def rlhf_load_model(role: str, path: str, config: Any) -> Iterator[Any]:
    model = yield
    if model is not None and enabled(config) and (role == "actor" or (role == "critic" and config.section("lora").critic)):
        model = apply_lora(model, config, role)
    return model


@hookimpl
def rlhf_after_train(run_dir: Path, metrics: Any) -> None:
    config_file = run_dir / "config.yaml"
    final = run_dir / "final"
    if not (final / "adapter_config.json").is_file():
        return
    import yaml

    if not (yaml.safe_load(config_file.read_text()).get("lora") or {}).get("save_merged"):
        return
    from peft import AutoPeftModelForCausalLM

    merged = AutoPeftModelForCausalLM.from_pretrained(str(final)).merge_and_unload()
    merged.save_pretrained(run_dir / "final-merged")


@hookimpl
def rlhf_weight_sync_methods() -> Iterable[WeightSyncMethod]:
    yield WeightSyncMethod(
        "adapter",
        factory=AdapterSync,
        description="LoRA: only the adapter moves; vLLM generates with its LoRA support",
        requires=("peft",),
        extra="peft",
    )


# --- weights -------------------------------------------------------------------------------

_PREFIX = "base_model.model."


def is_lora_name(name: str) -> bool:
    return ".lora_" in name or name.startswith("lora_")


def base_name(name: str) -> str:
    """PEFT's parameter name -> the base model's (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``)."""
    name = name.replace(".base_layer.", ".")
    return name.replace(_PREFIX, "", 1) if name.startswith(_PREFIX) or f".{_PREFIX}" in name else name


def merged_weights(named: Iterable[tuple[str, Any]], scaling: float) -> Iterator[tuple[str, Any]]:
    """Base-model weights with every LoRA pair folded in: ``W + scaling * B @ A``."""
    tensors = dict(named)
    lora_a = {n.split(".lora_A.")[0]: t for n, t in tensors.items() if ".lora_A." in n}
    lora_b = {n.split(".lora_B.")[0]: t for n, t in tensors.items() if ".lora_B." in n}
    for name, tensor in tensors.items():
        if is_lora_name(name):
            continue
        module = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if module is not None and module in lora_a and name.endswith(".weight"):
            a, b = lora_a[module], lora_b[module]
            tensor = tensor + scaling * (b.to(tensor.dtype) @ a.to(tensor.dtype))
        yield base_name(name), tensor


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


class AdapterSync:
    """``--sync.method adapter`` (set by ``--lora.sync adapter``)."""

    same_process = None

    def __init__(self, config: Any) -> None:
        self.config = config

    def sync(self, actor: Any, engine: Any, step: int) -> dict[str, Any]:
        import time

        start = time.perf_counter()
        weights, cfg = actor.adapter_state()
        info = engine.load_adapter(weights, cfg)
        info.update(method="adapter", rpcs=1, seconds=time.perf_counter() - start,
                    bytes=sum(t.numel() * t.element_size() for t in weights.values()))
        return info


def export_weights(model: Any, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """What a generation engine loads: LoRA merged in under base names, else the weights as they are."""
    info = peft_info(model)
    if info is None:
        yield from named
    else:
        yield from merged_weights(named, info[1])


def lora_config_from_dict(data: dict[str, Any]) -> Any:
    from peft import LoraConfig

    known = set(LoraConfig.__dataclass_fields__) - {"peft_type"}
    return LoraConfig(**{k: v for k, v in data.items() if k in known})
