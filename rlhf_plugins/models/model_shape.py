"""The shape of a decoder-only model: its sizes, counted exactly on the meta device from a config
(no weights loaded), and which of its tensors Muon steps. The memory models (``models/memory.py``), the
scale defaults and the benchmarks read it."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def uses_muon(name: str, tensor: Any) -> bool:
    """Muon's share (of Muon's authors, DeepSpeed, OpenRLHF): 2+ dimensions, neither embedding nor head."""
    return tensor.ndim >= 2 and not any(key in name.lower() for key in ("embed", "lm_head"))


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a decoder-only model's memory (counted exactly on the meta device)."""

    parameters: int
    #: parameters of the largest decoder layer (what ZeRO-3 gathers at once, besides the embedding)
    layer_parameters: int
    #: elements of the largest single tensor (usually the embedding)
    largest_tensor: int
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    q_dim: int
    kv_dim: int
    tied: bool
    #: the longest context the model takes (max_position_embeddings), when it says
    max_positions: int | None = None
    #: a mixture of experts: experts per layer, experts per token and one expert's width (0: dense)
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    #: elements of the hidden weight matrices (what ``--learner.optimizer muon`` steps with Muon)
    matrix_parameters: int = 0
    #: elements of Adafactor's second-moment statistics (a row and a column vector per matrix, the whole of
    #: every vector: ``--learner.optimizer adafactor``)
    factored_states: int = 0
    #: the model can return its routers' load-balancing loss (its config has ``output_router_logits``)
    router_loss: bool = False
    #: the soft cap of the model's logits (Gemma 2's ``final_logit_softcapping``), ``None`` if uncapped
    logit_softcap: float | None = None

    @property
    def kv_elements_per_token(self) -> int:
        """Keys and values of one token over all layers."""
        return 2 * self.layers * self.kv_dim

    def activation_elements_per_token(self, compiled: bool = False) -> int:
        """Elements one token of a training micro batch keeps for the backward pass in one layer
        (norm inputs and outputs, q/k/v and their rotary forms, attention output, the MLP's gate, up,
        activation and product): checked against the saved tensors of a real forward within 15%.
        ``compiled`` (``--learner.compile``): the compiled norms keep their inputs and recompute their
        outputs in the backward pass, the compiled MLP recomputes its activation (2 hidden-sized and 3
        intermediate-sized elements instead of 6 and 4), checked the same way."""
        norms_attention = (2 if compiled else 6) * self.hidden + 6 * self.q_dim + 4 * self.kv_dim
        if self.experts_per_token:  # the routed block (eager even when compiled)
            return norms_attention + self.moe_elements_per_token()
        return norms_attention + (3 if compiled else 4) * self.intermediate

    def moe_elements_per_token(self) -> int:
        """A mixture-of-experts block (transformers' experts loop): per token, each of its k experts
        keeps the gathered input, gate-up output, activation, product and weighted output (2kH + 4kI),
        the router its probabilities (2E); within 2% of the saved tensors of a Qwen3-MoE forward."""
        k, width = self.experts_per_token, self.expert_intermediate
        return 2 * k * self.hidden + 4 * k * width + 2 * self.experts

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        import torch
        from transformers import AutoModelForCausalLM

        from .logits import logit_softcap

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = list(model.parameters())
        layers = _decoder_layers(model)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        out = model.get_output_embeddings()
        return cls(
            parameters=sum(p.numel() for p in params),
            layer_parameters=max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0),
            largest_tensor=max(p.numel() for p in params),
            vocab=config.vocab_size,
            hidden=config.hidden_size,
            intermediate=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            layers=len(layers) or config.num_hidden_layers,
            q_dim=heads * head_dim,
            kv_dim=kv_heads * head_dim,
            tied=out is not None and out.weight is model.get_input_embeddings().weight,
            max_positions=getattr(config, "max_position_embeddings", None),
            matrix_parameters=sum(p.numel() for n, p in model.named_parameters() if uses_muon(n, p)),
            factored_states=sum(_factored(p.shape) for p in params),
            router_loss=hasattr(config, "output_router_logits"),
            logit_softcap=logit_softcap(config),
            **_experts(config),
        )

    @classmethod
    def of_folder(cls, path: str | Path, trust_remote_code: bool = False) -> ModelShape:
        return _shape_of(str(Path(path).expanduser().resolve()), trust_remote_code)


@functools.lru_cache(maxsize=8)
def _shape_of(path: str, trust_remote_code: bool) -> ModelShape:
    from transformers import AutoConfig

    return ModelShape.from_config(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))


def _experts(config: Any) -> dict[str, int]:
    """A mixture of experts' sizes from its config (Qwen-MoE ``num_experts``, Mixtral
    ``num_local_experts``; an expert's width is ``moe_intermediate_size`` or else the MLP's)."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    per_token = getattr(config, "num_experts_per_tok", None) or 0
    if not experts or not per_token:
        return {}
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return dict(experts=int(experts), experts_per_token=int(per_token), expert_intermediate=int(width))


def _decoder_layers(model: Any) -> list[Any]:
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    return list(max(lists, key=len)) if lists else []


def _factored(shape: Any) -> int:
    """Adafactor's second-moment elements for a tensor of ``shape``: its rows' and its columns' means for two
    or more dimensions, every element for one."""
    if len(shape) < 2:
        return int(math.prod(shape))
    return int(math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1])
