"""The PPO critic: a transformers backbone with a scalar value head on every token.

Initialised from the policy (the language-model head is dropped, the value head
starts at zero), from a reward model (its backbone and its head, normalisation folded in, as
OpenRLHF starts a critic from ``--reward_pretrain``), or from a saved critic folder, which
holds the backbone's ``save_pretrained`` files plus ``value_head.safetensors``. Its forward mirrors a
causal LM's (``logits`` of width 1, ``past_key_values``), so the shared-prefix
forward of :mod:`rlhf_plugins.models.forward` serves it unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .hf_names import cache_argument, checkpointing, enable_checkpointing, output_cache

HEAD_FILE = "value_head.safetensors"


@dataclass
class ValueOutput:
    logits: torch.Tensor
    past_key_values: Any = None


class ValueModel(torch.nn.Module):
    def __init__(self, backbone: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        self.value_head = torch.nn.Linear(backbone.config.hidden_size, 1, dtype=backbone.dtype)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, normalize: bool = False,
                        empty: bool = False) -> ValueModel:
        """``normalize``: a reward model's stored mean / std folded into the head (``--reward.normalize``);
        ``empty``: the backbone left with empty parameters where its checkpoint allows (a sharded
        learner reads its shards; :mod:`.empty_init`), else read tensor by tensor; the head whole."""
        from safetensors.torch import load_file
        from transformers import AutoModel

        from . import empty_init
        from .reward_model import find_reward_head

        head = Path(path) / HEAD_FILE
        if not head.is_file():
            info = find_reward_head(Path(path))  # None for a policy (causal LM): a fresh zero head
            if info is not None:
                from .reward_model import RewardHead

                backbone, reward_head = RewardHead.load(info, dtype, normalize)
                model = cls(backbone)
                model.value_head.load_state_dict(reward_head.state_dict())
                return model
        backbone = empty_init.build_empty(path, dtype, False, auto_class=AutoModel)
        if backbone is not None and not empty:
            backbone = empty_init.fill(backbone)
        model = cls(backbone or AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=False))
        if head.is_file():
            model.value_head.load_state_dict(load_file(str(head)))
        if backbone is not None and empty:
            empty_init.mark(model, empty_init.source_of(backbone))
        return model

    @property
    def is_activation_checkpointing(self) -> bool:
        return checkpointing(self.backbone)

    is_gradient_checkpointing = is_activation_checkpointing  # the name of transformers before 5.2x

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        enable_checkpointing(self.backbone, gradient_checkpointing_kwargs)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> ValueOutput:
        """``cache`` (or, by transformers' older name, ``past_key_values``): the KV cache to extend;
        ``kwargs`` reach the backbone's attention as they reach a causal LM's (a packed micro batch's
        ``packed_samples``: without them its completions would attend to each other)."""
        cache = past_key_values if cache is None else cache
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **cache_argument(self.backbone, cache),
            **kwargs,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return ValueOutput(self.value_head(hidden), output_cache(out) if use_cache else None)

    def save_pretrained(self, path: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
                        **kwargs: Any) -> None:
        """The backbone's folder plus ``value_head.safetensors``; ``state_dict`` (names of this model,
        e.g. tensors a sharded learner gathered) replaces the model's own tensors."""
        from safetensors.torch import save_file

        if state_dict is None:
            self.backbone.save_pretrained(path, **kwargs)
            head = self.value_head.state_dict()
        else:
            own = {k.removeprefix("backbone."): v for k, v in state_dict.items() if k.startswith("backbone.")}
            self.backbone.save_pretrained(path, state_dict=own, **kwargs)
            head = {k.removeprefix("value_head."): v for k, v in state_dict.items() if k.startswith("value_head.")}
        save_file({k: v.contiguous() for k, v in head.items()}, str(Path(path) / HEAD_FILE))
