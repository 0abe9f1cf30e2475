"""One place that checks a model folder before anything loads it, and turns what can be wrong
with it into one line naming the folder, the file and the fix: a missing or unreadable
``config.json``, no tokenizer, damaged or pickled weights, code the folder wants to run. And
:func:`save_pretrained`, how our processes write one."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
PICKLED = ("pytorch_model.bin", "*.bin", "*.pt", "*.pth", "*.ckpt")


def check_model_folder(path: str | Path, key: str = "model.path", *, trust_remote_code: bool = False,
                       tokenizer: bool = True) -> None:
    """Raise one line when ``path`` is not a loadable ``save_pretrained`` folder."""
    folder = Path(path).expanduser()
    where = f"{key} '{path}'"
    if not folder.is_dir():
        raise ConfigError(f"{where} does not exist or is not a folder; give a local save_pretrained folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{where} is not a save_pretrained folder (no config.json); "
                          "give a local model folder or leave it empty")
    try:
        text = config_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: config.json cannot be read ({exc}); the folder is damaged") from exc
    if not text.strip():
        raise ConfigError(f"{where}: config.json is empty; the folder is damaged (save the model again)")
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{where}: config.json is not valid JSON ({exc}); the folder is damaged") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConfigError(f"{where}: config.json names no model_type; it is not a transformers model folder")
    if config.get("auto_map") and not trust_remote_code:
        raise ConfigError(f"{where} needs its own Python code to load (auto_map in config.json), which is not run "
                          "unless you trust it: pass --model.trust_remote_code true")
    if tokenizer and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"{where} has no tokenizer ({' / '.join(TOKENIZER_FILES[:2])}); save the tokenizer beside "
                          "the model (tokenizer.save_pretrained)")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        pickled = [p.name for pattern in PICKLED for p in folder.glob(pattern)]
        if pickled:
            raise ConfigError(f"{where} holds pickled weights ({pickled[0]}), which rlhf-plugins does not load "
                              "(unpickling can run code); convert them to safetensors "
                              "(model.save_pretrained(path, safe_serialization=True))")
        raise ConfigError(f"{where} has no weights (*.safetensors)")
    from safetensors import safe_open

    for file in weights:
        try:
            with safe_open(str(file), framework="numpy") as f:
                f.keys()
        except Exception as exc:  # noqa: BLE001 - any header damage is one line
            raise ConfigError(f"{where}: '{file.name}' is not a readable safetensors file ({exc}); the folder is "
                              "damaged (save the model again)") from exc


def save_pretrained(model: Any, path: str | Path, **kwargs: Any) -> None:
    """``model.save_pretrained(path, **kwargs)``, without importing DeepSpeed in a process that has
    not: transformers has accelerate unwrap the model first, and accelerate imports DeepSpeed
    whenever it is installed to check for a ``DeepSpeedEngine`` (1.5-2 s of every run that saves).
    A model cannot be a DeepSpeed engine before DeepSpeed is imported, so the check is skipped then."""
    try:
        import accelerate.utils.other as unwrapping
    except ImportError:
        unwrapping = None
    if "deepspeed" in sys.modules or not hasattr(unwrapping, "is_deepspeed_available"):
        model.save_pretrained(path, **kwargs)
        return
    probe = unwrapping.is_deepspeed_available
    unwrapping.is_deepspeed_available = lambda: False
    try:
        model.save_pretrained(path, **kwargs)
    finally:
        unwrapping.is_deepspeed_available = probe
