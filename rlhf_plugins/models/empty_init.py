"""Loading a model without holding a copy of its weights it would not keep.

A learner that shards (FSDP2) asks for the model inside :func:`empty_weights`; the builtin loader
then builds the architecture with its parameters on the meta device (buffers such as rotary
frequencies are computed for real: they are not in checkpoints) and records where each parameter's
tensor is in the checkpoint (:class:`Source`). The critic's backbone is built the same way, its value
head made whole (it is small); LoRA adapters are made whole by PEFT over the empty layers
(:func:`wrappable`). The learner shards the empty model, gives each rank storage for its own shard, and
:func:`load_shards` reads each rank's rows of every tensor straight from the safetensors files (a
slice read, never the whole tensor). A generation engine whose first sync brings every weight
(broadcast, IPC) asks the same way and gets its parameters from that sync: aliased to the learner's
shared buffers under IPC, given storage as they arrive otherwise.

Only where it is exact: the checkpoint must hold every parameter under the model's own names and
shapes (the builtin loader checks before it builds anything empty; a checkpoint that transformers
converts while loading -- renamed or fused tensors -- loads whole, as before). Plugins that load the
model themselves, and LoRA initialisations computed from the base weights (PiSSA, OLoRA, DoRA...),
keep the whole load.
"""
from __future__ import annotations

import contextvars
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_EMPTY = contextvars.ContextVar("rlhf_empty_weights", default=False)
#: the attribute of an empty model naming the folder its weights are read from
SOURCE = "rlhf_weights_from"


@contextmanager
def empty_weights() -> Iterator[None]:
    """Ask the builtin loader for an empty model (parameters on the meta device) where it can."""
    token = _EMPTY.set(True)
    try:
        yield
    finally:
        _EMPTY.reset(token)


def wanted() -> bool:
    return _EMPTY.get()


def checkpoint_tensors(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of a safetensors checkpoint folder: name -> (file, shape), headers only."""
    from safetensors import safe_open

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else [p.name for p in folder.glob("*.safetensors")]
    out = {}
    for file in files:
        with safe_open(str(folder / file), "pt") as f:
            for name in f.keys():
                out[name] = (file, tuple(f.get_slice(name).get_shape()))
    return out


@dataclass(frozen=True, eq=False)
class Source:
    """Where an empty model's parameters are read from: the checkpoint folder, and each parameter's
    tensor in it, recorded by the module holding the parameter (modules outlive the wrappers that
    rename them: PEFT's LoRA, the critic's value model)."""

    folder: str
    tensors: dict[torch.nn.Module, dict[str, str]]

    def names(self, model: torch.nn.Module) -> dict[str, str]:
        """``model``'s parameter names (as ``named_parameters`` gives them) -> checkpoint tensor names."""
        return {f"{prefix}.{attr}" if prefix else attr: stored for prefix, module in model.named_modules()
                for attr, stored in self.tensors.get(module, {}).items()}


def build_empty(path: str, dtype: torch.dtype, trust_remote_code: bool,
                auto_class: Any = None) -> torch.nn.Module | None:
    """The architecture of ``path`` (``auto_class``: default ``AutoModelForCausalLM``; ``AutoModel`` for
    a backbone) with its parameters on the meta device, or None when the checkpoint does not hold
    every parameter under the model's names (or under its base-model prefix) and shapes, or while
    DeepSpeed ZeRO-3 partitions what ``from_pretrained`` loads."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():  # from_pretrained under DeepSpeed's zero.Init loads partitioned
        return None
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    auto = auto_class or AutoModelForCausalLM
    with init_empty_weights(include_buffers=False):  # buffers as from_pretrained makes them (rotary: float32)
        model = auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # the meta parameters are new objects: a tied head is tied again (from_pretrained does)
    try:
        stored = checkpoint_tensors(path)
    except (OSError, KeyError, ValueError):
        return None
    prefix, modules, tensors = getattr(model, "base_model_prefix", ""), dict(model.named_modules()), {}
    for name, param in model.named_parameters():
        found = [n for n in (name, f"{prefix}.{name}") if stored.get(n, (None, None))[1] == tuple(param.shape)]
        if not found:
            return None
        owner, _, attr = name.rpartition(".")
        tensors.setdefault(modules[owner], {})[attr] = found[0]
    if auto_class is None:
        try:  # stop tokens and sampling defaults, as from_pretrained reads them
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            pass
    mark(model, Source(str(path), tensors))
    return model


def mark(model: torch.nn.Module, source: Source) -> None:
    """Record on ``model`` (an empty model, or a model wrapping one) where its weights are read from."""
    setattr(model, SOURCE, source)


def source_of(model: torch.nn.Module) -> Source | None:
    """Where an empty model's weights are to be read from (None: the model holds its weights)."""
    return getattr(model, SOURCE, None) if any(p.is_meta for p in model.parameters()) else None


@contextmanager
def wrappable(model: torch.nn.Module) -> Iterator[None]:
    """For a wrapper that adds parameters beside an empty model's (PEFT puts each LoRA adapter on the
    device of the layer it wraps, where a meta layer would leave the adapter without its initial
    values): the meta parameters get CPU storage that is never written -- address space, not resident
    memory -- for the wrapping, and are empty again after it; the new parameters keep their values.
    Nothing to do for a model that holds its weights."""
    empty = [p for p in model.parameters() if p.is_meta]
    for param in empty:
        point_at(param, torch.empty(param.shape, dtype=param.dtype))
    try:
        yield
    finally:
        for param in empty:
            empty_again = torch.empty(param.shape, dtype=param.dtype, device="meta")
            torch.utils.swap_tensors(param, torch.nn.Parameter(empty_again, requires_grad=param.requires_grad))


def move_buffers(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """An empty model's buffers moved to ``device`` (its meta parameters cannot be moved)."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
    return model


def point_at(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    """Make ``param`` (the same object, so every module sharing it follows) hold ``tensor``'s storage;
    a meta parameter cannot take another device's data by ``.data =``, so its contents are swapped."""
    if param.is_meta:
        torch.utils.swap_tensors(param, torch.nn.Parameter(tensor, requires_grad=param.requires_grad))
    else:
        param.data = tensor


def check_filled(model: torch.nn.Module, who: str) -> None:
    """Refuse to compute with a model some of whose parameters were never given values."""
    empty = [n for n, p in model.named_parameters() if p.is_meta]
    if empty:
        raise RuntimeError(f"{who} started without weights and no sync has filled {empty[0]} "
                           f"({len(empty)} parameters empty): the learner's first weight sync did not reach it")


def load_shards(model: torch.nn.Module, source: Source, device: torch.device, dtype: torch.dtype | None = None) -> int:
    """Give an empty model storage on ``device`` and fill every parameter -- each rank's dim-0 shard
    of a sharded one, as FSDP2 cuts them (rank r holds rows from r * ceil(n / world)) -- from the
    checkpoint, rounded through ``dtype`` (the model's dtype, as ``from_pretrained`` would have loaded
    it, before a learner's float32 shards). Buffers keep the values computed at construction, and
    parameters the checkpoint does not hold (LoRA adapters, a fresh value head: made whole by their
    own code) their values or shards. Each tensor is read with only its file's pages of it mapped
    (``from_pretrained`` keeps the checkpoint mapped until the end: about 0.9 GB more at 0.5B).
    Returns the bytes read."""
    from safetensors import safe_open

    names = source.names(model)
    own = _give_storage(model, device, names, source.folder)
    stored, folder, read = checkpoint_tensors(source.folder), Path(source.folder), 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in own:
                continue
            file, shape = stored[names[name]]
            local = _local(param)
            start = _shard_start(param, shape[0]) if local is not param else 0
            with safe_open(str(folder / file), "pt") as handle:
                rows = handle.get_slice(names[name])
                value = rows[start : start + local.shape[0]] if local.dim() else rows[:]
            local.copy_(value.to(dtype or local.dtype).to(local.dtype))
            read += local.numel() * local.element_size()
    return read


def fill(model: torch.nn.Module) -> torch.nn.Module:
    """A model built empty (not sharded), given storage on the CPU and read from its checkpoint, in
    evaluation mode: what ``from_pretrained`` returns, without its peak."""
    source = source_of(model)
    if source is not None:
        load_shards(model, source, torch.device("cpu"))
    return model.eval()


def _give_storage(model: torch.nn.Module, device: torch.device, names: dict[str, str], folder: str) -> set[str]:
    """Storage on ``device`` for every empty parameter (buffers and the parameters the checkpoint
    does not hold keep their values); the names of the latter. An unsharded model's parameters keep
    their identity (a tied head stays tied); a sharded one's are FSDP2's to replace (``to_empty``)."""
    DTensor, _ = dtensor_types()
    own = {}
    for name, param in model.named_parameters():
        if name not in names:
            if _local(param).is_meta:
                raise RuntimeError(f"{name} is neither in the checkpoint {folder} nor initialised")
            own[name] = _local(param).detach().clone()
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        for param in model.parameters():
            if param.is_meta:
                point_at(param, torch.empty(param.shape, dtype=param.dtype, device=device))
        move_buffers(model, device)
        return set(own)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
        for name, value in own.items():
            _local(model.get_parameter(name)).copy_(value)
    return set(own)


def dtensor_types() -> tuple[type, type]:
    """torch's ``DTensor`` and ``Shard``: public in ``torch.distributed.tensor`` from torch 2.5, in
    ``torch.distributed._tensor`` on torch 2.4 (the floor setup.cfg declares)."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import DTensor, Shard
    return DTensor, Shard


@torch.no_grad()
def mix_into_shards(model: torch.nn.Module, named: Any, alpha: float) -> int:
    """Move each parameter of a sharded model towards the given full tensor (``lerp`` by ``alpha``;
    1 copies), each rank its own dim-0 rows. Returns the tensors moved; an unknown name is an error."""
    params, count = dict(model.named_parameters()), 0
    for name, full in named:
        param = params.get(name)
        if param is None:
            raise KeyError(f"the sharded model has no parameter '{name}'")
        local = _local(param)
        start = _shard_start(param, full.shape[0]) if local is not param else 0
        rows = full[start : start + local.shape[0]] if local.dim() else full
        local.lerp_(rows.to(device=local.device, dtype=local.dtype), alpha)
        count += 1
    return count


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded parameter (the parameter itself when it is not sharded)."""
    DTensor, _ = dtensor_types()
    return param.to_local() if isinstance(param, DTensor) else param


def _shard_start(param: Any, rows: int) -> int:
    """The first row of this rank's dim-0 shard (FSDP2 cuts as ``torch.chunk`` does)."""
    _, Shard = dtensor_types()
    if tuple(param.placements) != (Shard(0),):
        raise NotImplementedError(f"loading shards placed as {param.placements}; FSDP2 places Shard(0)")
    mesh = param.device_mesh
    return mesh.get_local_rank() * -(-rows // mesh.size())
