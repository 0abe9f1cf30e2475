"""One place that checks a model folder before anything loads it, and turns what can be wrong
with it into one line naming the folder, the file and the fix: a missing or unreadable
``config.json``, no tokenizer, damaged or pickled weights, code the folder wants to run. And
:func:`save_pretrained`, how our processes write one."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError, hub_download

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
PICKLED = ("pytorch_model.bin", "*.bin", "*.pt", "*.pth", "*.ckpt")


def pickled_weights(folder: Path) -> list[str]:
    """The pickled weight files of a folder that holds no safetensors weights (which runs do not load)."""
    if any(folder.glob("*.safetensors")):
        return []
    return [p.name for pattern in PICKLED for p in sorted(folder.glob(pattern))]


def not_a_model_folder(where: str, folder: Path) -> str:
    """The line for a folder without config.json: a LoRA adapter alone (a LoRA run's ``final/``) names
    what to give instead -- the run's merged model when it wrote one, else the adapter's base; a Hub id names
    how to fetch it."""
    hub = hub_download(folder)
    if hub:
        return f"{where} does not exist here; {hub} and give DIR"
    if not (folder / "adapter_config.json").is_file():
        return f"{where} is not a save_pretrained folder (no config.json); give a local model folder or leave it empty"
    merged = folder.parent / f"{folder.name}-merged"
    policy = where.startswith("model.path")  # the policy's adapter can be trained on from its base
    go_on = "; or, to go on training it, its base as --model.path and it as --lora.adapter" if policy else ""
    if (merged / "config.json").is_file():
        return (f"{where} holds a LoRA adapter alone, not a whole model; give the model with it merged in: "
                f"'{merged}'{go_on}")
    try:
        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    named = f" ('{base}')" if base else ""
    return (f"{where} holds a LoRA adapter alone, not a whole model; merge it into its base model{named} and give "
            f"that folder (PEFT's merge_and_unload; a LoRA run writes <run>/final-merged with --lora.save_merged true)"
            f"{go_on}")


def check_model_folder(path: str | Path, key: str = "model.path", *, trust_remote_code: bool | None = False,
                       tokenizer: bool = True) -> None:
    """Raise one line when ``path`` is not a loadable ``save_pretrained`` folder (``trust_remote_code`` None: a
    command that never runs a model's own code)."""
    folder = Path(path).expanduser()
    where = f"{key} '{path}'"
    if not folder.is_dir():
        hub = hub_download(path)
        raise ConfigError(f"{where} does not exist here; {hub} and give DIR" if hub else
                          f"{where} does not exist or is not a folder; give a local save_pretrained folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(not_a_model_folder(where, folder))
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
        how = ("unless you trust it: pass --model.trust_remote_code true" if trust_remote_code is False else
               "by the stages (TRL's trainers here load what transformers itself defines): give such a model")
        raise ConfigError(f"{where} needs its own Python code to load (auto_map in config.json), which is not run "
                          f"{how}")
    if tokenizer and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"{where} has no tokenizer ({' / '.join(TOKENIZER_FILES[:2])}); save the tokenizer beside "
                          "the model (tokenizer.save_pretrained)")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        pickled = pickled_weights(folder)
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


#: the largest safetensors file a model folder or checkpoint is written in (transformers' own default is
#: 50 GB: one file per model); larger weights are split with an index, as the hub's models are
SHARD_BYTES = 2 * 2**30


class ShardWriter:
    """Writes tensors arriving one at a time as safetensors shards of at most ``SHARD_BYTES`` plus
    ``model.safetensors.index.json`` (one ``model.safetensors`` when everything fits in one): what
    ``from_pretrained`` and vLLM read, while the writer holds at most one shard. ``sizes`` (name ->
    bytes, in arrival order) plans the shards up front, so each file has its final name."""

    def __init__(self, folder: str | Path, sizes: dict[str, int], shard_bytes: int = SHARD_BYTES) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        shards: list[list[str]] = [[]]
        used = 0
        for name, size in sizes.items():
            if shards[-1] and used + size > shard_bytes:
                shards.append([])
                used = 0
            shards[-1].append(name)
            used += size
        n = len(shards)
        self.file_of = {name: ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
                        for i, names in enumerate(shards) for name in names}
        self.last_of_file = {names[-1]: self.file_of[names[-1]] for names in shards if names}
        self.total = sum(sizes.values())
        self.pending: dict[str, Any] = {}

    def add(self, name: str, tensor: Any) -> None:
        from safetensors.torch import save_file

        self.pending[name] = tensor.detach().contiguous()
        if name in self.last_of_file:
            save_file(self.pending, str(self.folder / self.last_of_file[name]), metadata={"format": "pt"})
            self.pending = {}

    def close(self) -> None:
        import json

        if self.pending:
            raise ValueError(f"tensors {sorted(self.pending)[:3]} arrived but their shard was never completed")
        if len(set(self.file_of.values())) > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": self.file_of}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


#: a reference model whose vocabulary is smaller than the policy's tokenizer, why it matters (rlhf train's
#: --model.reference_path and the dpo / kto stages' reference)
REFERENCE_VOCAB = ("'s tokenizer {ours}; the reference scores the policy's tokens, so it needs the policy's tokenizer: "
                   "pick a reference of the policy's family")


def tokenizer_size(folder: str | Path, trust_remote_code: bool = False) -> int | None:
    """The size of the tokenizer saved in ``folder``; None where there is none to read (whatever loads the
    folder later gives that line)."""
    from transformers import AutoTokenizer

    try:
        return len(AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code))
    except (OSError, ValueError):
        return None


def load_shards(model: Any, folder: str | Path) -> None:
    """Load a checkpoint's safetensors shards (or its one file) into ``model`` one shard at a time.
    Every tensor of the model must be loaded, a tied tensor through the name it was saved under."""
    import json

    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    loaded: set[str] = set()
    for name in files:
        shard = load_file(str(folder / name))
        model.load_state_dict(shard, strict=False)
        loaded |= shard.keys()
        del shard
    state = model.state_dict()
    pointers = {state[k].data_ptr() for k in loaded if k in state}
    missing = [k for k, t in state.items() if k not in loaded and t.data_ptr() not in pointers]
    unexpected = sorted(loaded - state.keys())
    if missing or unexpected:
        raise ValueError(f"checkpoint '{folder}' does not match the model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")


def save_pretrained(model: Any, path: str | Path, **kwargs: Any) -> None:
    """``model.save_pretrained(path, **kwargs)``, without importing DeepSpeed in a process that has
    not: transformers has accelerate unwrap the model first, and accelerate imports DeepSpeed
    whenever it is installed to check for a ``DeepSpeedEngine`` (1.5-2 s of every run that saves).
    A model cannot be a DeepSpeed engine before DeepSpeed is imported, so the check is skipped then.
    Weights are written in shards of at most :data:`SHARD_BYTES`."""
    kwargs.setdefault("max_shard_size", SHARD_BYTES)
    if getattr(model, "peft_config", None):  # an adapter alone: the base's embeddings never change here (PEFT
        kwargs.setdefault("save_embedding_layers", False)  # would save them whole when LoRA adapts them)
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


def save_tokenizer(tokenizer: Any, path: str | Path) -> None:
    """``tokenizer.save_pretrained(path)`` naming the class every supported transformers loads:
    transformers 5 writes ``TokenizersBackend``, which 4.x does not know; both read
    ``PreTrainedTokenizerFast`` as the same fast tokenizer."""
    tokenizer.save_pretrained(str(path))
    config_file = Path(path) / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        if config.get("tokenizer_class") == "TokenizersBackend":
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            config_file.write_text(json.dumps(config, indent=2) + "\n")
