"""Keep vLLM's class patches on vLLM's own model.

vLLM (0.32) serves a number of architectures through its Transformers backend (its registry maps
OLMo, OLMo-2 and -3, Phi-2, GPT-NeoX, StarCoder2, SmolLM3, GPTBigCode and others to
``TransformersForCausalLM``): it builds transformers' own modeling classes, and to compile them it
decorates the decoder *class* in place (``support_torch_compile``: an ``__init__`` that needs a
current vLLM config, a ``__call__`` that reads attributes only that ``__init__`` sets, one more base
class). Every other model of that class in the process changes with it: where the engine shares its
process with the learner or the reference (local placement, ``--ray.colocate hybrid``), building the
learner's model after the engine started failed ("Current vLLM config is not set"), and a model built
before it failed at its first forward.

:func:`vllm_class_patches_confined` wraps the engine's start: it records the architecture's
transformers classes before, and afterwards moves what vLLM added to a class into a subclass of it
that only vLLM's own instances take (their behaviour unchanged, compiled or not), restoring the class
itself for everyone else.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger("rlhf_plugins")

#: a class's state as it was: its own attributes and its bases
State = tuple[dict[str, Any], tuple[type, ...]]


def _model_classes() -> list[type]:
    """Every subclass of transformers' ``PreTrainedModel`` defined so far."""
    from transformers import PreTrainedModel

    seen: list[type] = []
    stack = [PreTrainedModel]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen.append(sub)
                stack.append(sub)
    return seen


def _import_architecture(model_path: str, trust_remote_code: bool) -> None:
    """Import the transformers classes of the model in ``model_path`` (vLLM's Transformers backend
    decorates its base model class), so that their state can be recorded before the engine starts."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        for auto in (AutoModel, AutoModelForCausalLM):
            auto._model_mapping[type(config)]  # noqa: B018  (the lazy mapping imports the class)
    except (KeyError, ValueError, OSError, ImportError):  # a custom architecture: nothing to import by name
        pass


def snapshot(classes: list[type]) -> dict[type, State]:
    return {cls: (dict(vars(cls)), cls.__bases__) for cls in classes}


def confine(before: dict[type, State]) -> dict[type, type]:
    """For each class in ``before`` that gained a base since (vLLM's decoration): a subclass holding
    that base and the attributes added or replaced, and the class restored. Returns
    ``{class: its patched subclass}``."""
    moved: dict[type, type] = {}
    for cls, (attrs, bases) in before.items():
        added_bases = tuple(b for b in cls.__bases__ if b not in bases)
        if not added_bases:  # vLLM's decoration always adds a base; anything else is not ours to move
            continue
        changed = {k: v for k, v in vars(cls).items()
                   if (k not in attrs or attrs[k] is not v) and k not in ("__dict__", "__weakref__")}
        patched = type(cls.__name__, (cls, *added_bases), {**changed, "__module__": cls.__module__,
                                                            "__qualname__": cls.__qualname__})
        for key in changed:
            if key in attrs:
                setattr(cls, key, attrs[key])
            else:
                delattr(cls, key)
        cls.__bases__ = bases
        moved[cls] = patched
    return moved


def reclass(model: Any, moved: dict[type, type]) -> int:
    """Give each module of ``model`` whose class was confined its patched subclass. Returns how many."""
    done = 0
    for module in model.modules():
        patched = moved.get(type(module))
        if patched is not None:
            module.__class__ = patched
            done += 1
    return done


@contextmanager
def vllm_class_patches_confined(model_path: str, trust_remote_code: bool) -> Iterator[dict[type, type]]:
    """Around an engine's start: afterwards, the classes vLLM patched are as they were, and the
    returned mapping (filled on exit) names the subclass each patched class's instances in the engine
    must take (:func:`reclass`)."""
    _import_architecture(model_path, trust_remote_code)
    before = snapshot(_model_classes())
    moved: dict[type, type] = {}
    try:
        yield moved
    finally:
        moved.update(confine(before))
        if moved:
            logger.debug("vLLM patched %s; confined to the engine's model", ", ".join(c.__name__ for c in moved))
