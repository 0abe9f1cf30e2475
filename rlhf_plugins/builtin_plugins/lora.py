"""PEFT integration: LoRA on the actor (and critic) by wrapping model loading.

``--lora.rank 8`` (or ``--lora.config adapter_config.json``) wraps whatever the
``rlhf_load_model`` hook loaded with PEFT, for the torch and DeepSpeed learners
alike. Two ways to bring LoRA weights to the generation engine:

* by default the learner exports ``W + scale * B @ A`` under the base model's names, through
  whichever weight-sync method runs;
* ``--sync.method adapter``: only the adapter moves; vLLM generates with its LoRA support, the
  transformers engine wraps itself with PEFT.

Saving writes the adapter in PEFT's format; ``--lora.save_merged`` also writes the
merged model next to it.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._markers import hookimpl
from ..errors import ConfigError
from ..models.folder import save_pretrained
from ..settings import setting


@dataclass
class LoraOptions:
    #: LoRA rank; 0 disables LoRA
    rank: int = setting(0, ge=0)
    #: LoRA scaling numerator (the update is scaled by alpha / rank)
    alpha: float = setting(16.0, gt=0)
    #: dropout on the LoRA input
    dropout: float = setting(0.0, ge=0, lt=1)
    #: module names (suffixes) to adapt, or "all-linear"
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    #: a PEFT ``adapter_config.json`` (or its folder) instead of the fields above
    config: str | None = None
    #: a trained adapter's folder (a LoRA run's ``final/``, PEFT's save_pretrained) to go on training: its
    #: config and its weights; the engine gets the adapted policy before the first rollout
    adapter: str | None = None
    #: also put LoRA on the critic's backbone
    critic: bool = True
    #: after training, also save base + adapter merged into ``<run>/final-merged``
    save_merged: bool = False


def enabled(config: Any) -> bool:
    o = getattr(config, "extra", {}).get("lora")  # absent from a Config built without plugins
    return o is not None and (o.rank > 0 or o.config is not None or o.adapter is not None)


def reads_base_weights(config: Any) -> bool:
    """Whether LoRA is on with an initialisation computed from the base weights (PiSSA, OLoRA,
    LoftQ, DoRA's magnitudes...): the base must then be loaded before the adapters are made."""
    if not enabled(config):
        return False
    cfg = lora_config(config)
    return cfg.init_lora_weights not in (True, False, "gaussian") or bool(getattr(cfg, "use_dora", False))


def lora_config(config: Any) -> Any:
    from peft import LoraConfig

    o = config.section("lora")
    if o.config or o.adapter:
        path = Path(o.adapter or o.config)
        path = path / "adapter_config.json" if path.is_dir() else path
        from ..models.lora import lora_config_from_dict

        # a saved adapter's config says inference_mode: true (PEFT sets it on saving), which would freeze it;
        # its base_model_name_or_path names where it was trained, PEFT sets this run's
        return lora_config_from_dict({**json.loads(path.read_text()), "inference_mode": False,
                                      "base_model_name_or_path": None})
    targets: Any = o.target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    return LoraConfig(r=o.rank, lora_alpha=o.alpha, lora_dropout=o.dropout, target_modules=targets, bias="none")


def linear_names(model: Any) -> list[str]:
    """The names of the model's linear layers, torch's and GPT-2's Conv1D (what "all-linear" adapts)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, (torch.nn.Linear, Conv1D))})


def apply_lora(model: Any, config: Any, role: str) -> Any:
    from peft import get_peft_model

    from ..models.empty_init import wrappable
    from ..models.lora import quiet_peft_wrapping

    cfg = lora_config(config)
    target = model.backbone if role == "critic" else model
    tied = tied_embedding_names(target)
    try:  # an empty model's adapters are made whole, with PEFT's own initialisation
        with wrappable(target), quiet_peft_wrapping():
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
    if config.section("lora").adapter:
        load_adapter_weights(wrapped, config.section("lora").adapter)
    if config.sync.method != "adapter":  # the engine gets merged weights: a LoRA that cannot merge stops here
        from ..models.lora import adapted_layers

        _refuse_tied_adapters(set(adapted_layers(wrapped)) | set(cfg.modules_to_save or ()), tied)
    return wrapped


def load_adapter_weights(model: Any, folder: str) -> None:
    """A trained adapter's weights (``--lora.adapter``) into the freshly wrapped policy, by PEFT's loader;
    one that does not fit the model is one line."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    from ..models.lora import ADAPTER, is_lora_name

    try:
        result = set_peft_model_state_dict(model, load_peft_weights(folder, device="cpu"), adapter_name=ADAPTER)
    except RuntimeError as exc:  # torch's size mismatch
        why = str(exc).strip().splitlines()[-1].strip()
        raise ConfigError(f"lora.adapter '{folder}' does not fit the model of --model.path ({why}); give the base "
                          "model it was trained on") from exc
    missing = [k for k in result.missing_keys if is_lora_name(k)]
    if missing or result.unexpected_keys:
        raise ConfigError(f"lora.adapter '{folder}' does not fit the model of --model.path (no "
                          f"{(missing or result.unexpected_keys)[0]}); give the base model it was trained on")


def tied_embedding_names(model: Any) -> set[str]:
    """The input embeddings' and the output head's module names when the two share one weight."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None or getattr(inputs, "weight", None) is not getattr(outputs, "weight", 0):
        return set()
    return {name for name, module in model.named_modules() if module is inputs or module is outputs}


def _refuse_tied_adapters(adapted: set[str], tied: set[str]) -> None:
    """A tied embedding / head pair is one tensor in the engine: a LoRA (or a trained copy) on either side
    changes one of the two, which merged weights cannot say."""
    hit = sorted(n for n in tied if n in adapted or n.rsplit(".", 1)[-1] in adapted)
    if hit:
        raise ConfigError(f"the model's input embeddings and output head share one weight (tie_word_embeddings), "
                          f"and the LoRA config adapts {hit[0]}, which merged weights cannot give the engine; leave "
                          f"{hit[0].rsplit('.', 1)[-1]} out of the LoRA config, or use --sync.method adapter")


@hookimpl
def rlhf_add_options(options: Any) -> None:
    options.add_section("lora", LoraOptions)


@hookimpl
def rlhf_configure(config: Any, plan: Any) -> None:
    o = config.section("lora")
    if plan.sync.needs_adapter and not enabled(config):
        raise ConfigError(f"weight sync '{plan.sync.name}' moves a LoRA adapter alone: set --lora.rank "
                          "(or --lora.config), or choose another --sync.method")
    if not enabled(config):
        return
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConfigError("LoRA needs peft, which is not installed: pip install 'rlhf-plugins[peft]'")
    if o.config and not Path(o.config).exists():
        raise ConfigError(f"lora.config '{o.config}' does not exist; give a PEFT adapter_config.json or its folder")
    if o.config and Path(o.config).is_dir() and any(Path(o.config).glob("adapter_model.*")):
        logging.getLogger("rlhf_plugins").warning(
            "lora.config '%s' holds adapter weights too; only its config is read: the adapter starts as PEFT "
            "initialises it (to go on from its trained weights, give the folder as --lora.adapter)", o.config)
    if o.adapter:
        check_adapter_folder(o)
        plan.actor_moved = True  # the engine starts from the base: it gets the adapted policy first
    if config.model.fp32_lm_head and _adapts_head(o):
        raise ConfigError("model.fp32_lm_head keeps the output head a plain float32 layer, and the LoRA config "
                          "adapts lm_head (target_modules or modules_to_save); leave lm_head out of it or drop "
                          "--model.fp32_lm_head")


def check_adapter_folder(o: Any) -> None:
    """--lora.adapter (``o``: the lora section): a folder with PEFT's config and weights, given alone."""
    folder = Path(o.adapter)
    if o.config or o.rank:
        raise ConfigError("lora.adapter takes the trained adapter's own config: drop --lora.config and --lora.rank")
    if not (folder / "adapter_config.json").is_file() or not any(folder.glob("adapter_model.*")):
        raise ConfigError(f"lora.adapter '{o.adapter}' is not a trained LoRA adapter's folder (adapter_config.json "
                          "and adapter_model.safetensors, as PEFT's save_pretrained and a LoRA run's final/ hold)")


def _adapts_head(o: Any) -> bool:
    """Whether the LoRA config names the output head among its targets or its fully trained modules."""
    names: list[Any] = list(o.target_modules)
    if o.config:
        path = Path(o.config)
        saved = json.loads((path / "adapter_config.json" if path.is_dir() else path).read_text())
        names = [name for key in ("target_modules", "modules_to_save")
                 for name in ([saved[key]] if isinstance(saved.get(key), str) else saved.get(key) or [])]
    return any(isinstance(name, str) and name.rsplit(".", 1)[-1] == "lm_head" for name in names)


@hookimpl(wrapper=True)
def rlhf_load_model(role: str, path: str, config: Any) -> Iterator[Any]:
    model = yield
    adapted = role == "actor" or (role == "critic" and config.section("lora").critic)
    if model is not None and enabled(config) and adapted:
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
    from transformers import AutoTokenizer

    merged = AutoPeftModelForCausalLM.from_pretrained(str(final)).merge_and_unload()
    save_pretrained(merged, run_dir / "final-merged")
    AutoTokenizer.from_pretrained(str(final)).save_pretrained(run_dir / "final-merged")
