"""``--model.fp32_lm_head``: a 16-bit model whose output head keeps float32 weights and computes its
logits in float32 (the ScaleRL recipe; TRL's ``cast_lm_head_to_fp32``).

A bfloat16 head rounds every logit to 8 bits of mantissa before the log-softmax, and with a
151,936-entry vocabulary those roundings move the log-probs of the sampled tokens -- the importance
ratios and the mismatch between the engine's and the learner's log-probs that the ratio corrections
exist for. Here the head's weight is float32 in the policy, the reference and the transformers engine
(the roles that compute log-probs), its input is widened to float32 and its matrix product runs with
autocast off, so its logits are float32 whatever the precision of the rest. A tied input embedding
shares the weight, so it is float32 too; its output is cast back to the model's dtype, so the decoder
runs as before. The learner trains the float32 weight directly: it is its own master
(:mod:`rlhf_plugins.learners.master_weights` keeps copies of the 16-bit weights only). A vLLM engine
is asked for float32 logits through its own ``head_dtype``
(:func:`rlhf_plugins.engines.vllm_arguments.engine_arguments`): it keeps its head's weights in 16
bits, each sync rounding the learner's to them.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ..errors import ConfigError
from .model_parts import output_embeddings, unwrapped

#: set (to True) on an output head that computes in float32 (read by :func:`.fused_head.compute_dtype`)
FLOAT32_HEAD = "rlhf_float32_head"
#: the roles whose model gets the float32 head (those that compute the policy's log-probs)
ROLES = ("actor", "reference", "generation")


def float32_head(model: Any) -> None:
    """Make ``model``'s output head float32 (weights and logits), in place; a tied input embedding
    then hands the decoder its output in the model's dtype as before."""
    head = output_embeddings(model)
    if type(head) is not torch.nn.Linear:
        kind = type(head)
        found = "no output head" if head is None else f"a {kind.__module__.split('.')[0]} {kind.__name__} output head"
        raise ConfigError(f"model.fp32_lm_head needs a plain linear output head, and the model has {found} (a "
                          "LoRA adapter on lm_head is one: drop lm_head from --lora.target_modules); drop "
                          "--model.fp32_lm_head")
    dtype = head.weight.dtype
    embedding = unwrapped(model).get_input_embeddings()
    tied = embedding is not None and embedding.weight is head.weight
    head.float()  # swaps the parameter's data: a tied embedding's weight is the same parameter
    head.forward = partial(_float32_linear, head)
    setattr(head, FLOAT32_HEAD, True)
    if tied and dtype != torch.float32:
        embedding.register_forward_hook(partial(_cast_output, dtype))


def is_float32_head(head: torch.nn.Module) -> bool:
    return bool(getattr(head, FLOAT32_HEAD, False))


def weights_dtype(model: Any) -> torch.dtype:
    """The dtype of ``model``'s weights, those of a float32 head (and its tied embedding) aside."""
    head = output_embeddings(model)
    skip = head.weight if head is not None and is_float32_head(head) else None
    return next((p.dtype for p in model.parameters() if p is not skip), torch.float32)


def _float32_linear(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):
        return torch.nn.functional.linear(hidden.to(head.weight.dtype), head.weight, head.bias)


def _cast_output(dtype: torch.dtype, module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output.to(dtype)
