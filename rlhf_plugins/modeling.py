"""Forward passes shared by learners, the reference model and the transformers engine.

A batch is a dict of tensors: ``sequences`` (left-padded prompt + right-padded
completion, ``[B, P + T]``), ``attention_mask`` and ``action_mask`` (``[B, T]``,
1 on completion tokens).
"""
from __future__ import annotations

from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] without materialising the full log-softmax."""
    logits = logits.float()
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def policy_forward(
    model: Any, batch: dict[str, torch.Tensor], temperature: float = 1.0, with_entropy: bool = False
) -> dict[str, torch.Tensor]:
    """Log-probs (and entropy) of the completion tokens under ``model`` at the sampling temperature."""
    seq = batch["sequences"]
    mask = batch["attention_mask"]
    T = batch["action_mask"].shape[1]
    out = model(
        input_ids=seq, attention_mask=mask, position_ids=position_ids(mask), logits_to_keep=T + 1, use_cache=False
    )
    logits = out.logits[:, :-1, :]
    if temperature != 1.0:
        logits = logits / temperature
    result = {"logprobs": logprobs_from_logits(logits, seq[:, -T:])}
    if with_entropy:
        result["entropy"] = entropy_from_logits(logits)
    return result


def split_batch(batch: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """Consecutive slices of ``size`` samples (the last may be shorter)."""
    n = batch["sequences"].shape[0]
    return [{k: _take(v, slice(i, i + size)) for k, v in batch.items()} for i in range(0, n, size)]


def _take(v: Any, idx: slice) -> Any:
    return v[idx] if torch.is_tensor(v) or isinstance(v, list) else v


def concat_batches(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in parts[0]:
        vals = [p[k] for p in parts]
        out[k] = torch.cat(vals) if torch.is_tensor(vals[0]) else vals[0]
    return out
