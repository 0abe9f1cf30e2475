"""``--learner.router_aux_loss_coef``: a mixture of experts' load-balancing loss in the policy's update
(TRL's ``router_aux_loss_coef``, OpenRLHF's ``--aux_loss_coef``).

Switch Transformer's auxiliary loss, ``E * sum_e f_e * P_e`` -- ``f_e`` the share of (token, layer)
routings that pick expert ``e`` among their top k, ``P_e`` its mean router probability -- keeps a
mixture of experts from routing most tokens to a few experts. transformers computes it, for models whose
config has ``output_router_logits`` (Qwen2/3-MoE, Mixtral, OLMoE, gpt-oss, ...), as the ``aux_loss`` of
a forward asked for its router logits, over the real tokens of its attention mask; TRL adds that times
its coefficient to each micro batch's loss. Here each training micro batch's forward is asked for its
router logits and the same loss is computed from them over the micro batch's real tokens -- the padded
layout's attention mask, or a packed row's slots other than padding (a packed forward has no mask to
give transformers) -- and added, times the coefficient, to that micro batch's loss, weighted as the micro
batch is (its share of the mini batch's tokens).

TRL runs every sample whole, each one's prompt tokens counted. So while the loss is on, the policy's
micro batches run every sample whole as well: a GRPO group's prompt is not shared by its samples
(:mod:`.prompt_cache`, :mod:`.packing`), whose shared forward would count its tokens once per group.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .model_parts import model_config, unwrapped


def coefficient(model: Any, setting: float | None) -> float:
    """The coefficient of the load-balancing loss for ``model`` (0: none): ``setting``, or when it is
    None the model config's own ``router_aux_loss_coef`` -- for a model that returns router logits."""
    config = model_config(model)
    if not hasattr(config, "output_router_logits"):
        return 0.0
    if setting is None:
        return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    return float(setting)


@contextmanager
def router_logits(model: Any) -> Iterator[list[tuple[torch.Tensor, ...]]]:
    """Inside, every forward of ``model`` returns its router logits (``output_router_logits``): one tuple
    per forward, one ``[positions, experts]`` tensor per routed layer, appended to the yielded list."""
    inner = unwrapped(model)
    calls: list[tuple[torch.Tensor, ...]] = []

    def kept(module: Any, args: Any, output: Any) -> None:
        logits = getattr(output, "router_logits", None)
        if logits:
            calls.append(tuple(logits))

    config = inner.config
    before = config.output_router_logits
    config.output_router_logits = True
    handle = inner.register_forward_hook(kept)
    try:
        yield calls
    finally:
        handle.remove()
        config.output_router_logits = before


def load_balancing_loss(model: Any, logits: tuple[torch.Tensor, ...], real: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's loss from one forward's router logits over its ``real`` positions (a mask
    shaped as the forward's tokens), with the model's experts and experts per token."""
    config = unwrapped(model).config
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    return switch_loss(logits, int(experts), int(config.num_experts_per_tok), real)


def switch_loss(logits: tuple[torch.Tensor, ...], experts: int, top_k: int, real: torch.Tensor) -> torch.Tensor:
    """``experts * sum_e f_e * P_e`` over every (real position, layer): ``f_e`` the share of top-``top_k``
    picks that go to expert ``e``, ``P_e`` its mean softmax probability (transformers'
    ``load_balancing_loss_func``; its ``f_e`` counts each of a position's k picks, so it sums to k)."""
    weight = real.reshape(-1).to(torch.float32)
    picks = torch.zeros(experts, dtype=torch.float32, device=weight.device)
    probs = torch.zeros(experts, dtype=torch.float32, device=weight.device)
    for layer in logits:
        p = torch.softmax(layer.to(weight.device, torch.float32), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        picks = picks.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        probs = probs + (p * weight[:, None]).sum(0)
    rows = weight.sum() * len(logits)
    return experts * torch.sum((picks / rows) * (probs / rows))
