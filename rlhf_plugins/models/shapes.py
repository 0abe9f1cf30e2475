"""Random-weight models of real public shapes, built offline.

Memory, speed and vocabulary-dependent code can only be judged at a real size, and our machines
reach no model hub. These builders take the exact public ``config.json`` values of popular base
models (vocabulary, hidden size, layers, grouped-query heads, tied embeddings, RoPE), draw random
weights and save them with the embedded model's tokenizer beside them (its ids are a subset of the
model's vocabulary). ``layers`` / ``hidden`` override the depth and width for a *reduced* model that
keeps the real vocabulary, head size and tying -- what CI runs.

    from rlhf_plugins.models.shapes import build
    build("qwen2.5-0.5b", "qwen-0.5b-shape")                 # 494M parameters, 1 GB in bfloat16
    build("qwen2.5-0.5b", "qwen-reduced", layers=2, hidden=128)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

#: exact public configurations (the fields that shape the model; the rest are transformers' defaults)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
    # a mixture of experts: 128 experts per layer, 8 of them per token (30.5B parameters, 3.3B active)
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
        norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # a mixture of experts with attention sinks, biased experts (experts x in x out) and alternating
    # sliding-window layers (21B parameters, 3.6B active)
    "gpt-oss-20b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, swiglu_limit=7.0, max_position_embeddings=131072, rope_theta=150000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096}),
    # a mixture of experts whose checkpoint names transformers changes on load (block_sparse_moe -> mlp,
    # per-expert w1 / w3 / w2 -> fused gate_up_proj / down_proj): 8 experts, 2 per token (46.7B parameters)
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None,
        tie_word_embeddings=False),
    # a mixture of experts with a gated shared expert beside 60 routed ones, 4 per token (14.3B
    # parameters); vLLM 0.32's own implementation computes it differently from transformers on CPU
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
        decoder_sparse_step=1, norm_topk_prob=False, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=8192, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False),
    # an architecture vLLM serves through its Transformers backend (transformers' own modeling classes)
    "olmo-2-1b": dict(
        model_type="olmo2", vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096, rope_theta=500000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False),
}


#: shapes built only reduced on our machines (full size: 61, 42, 93 and 29 GB in bfloat16, more than a 24 GB node)
REDUCED_ONLY = ("qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b", "qwen1.5-moe-a2.7b")


def shape_config(name: str, *, layers: int | None = None, hidden: int | None = None) -> Any:
    """The transformers config of ``name``, optionally reduced to ``layers`` and ``hidden`` (heads
    scaled to keep the head size and the query / key-value ratio where the width allows)."""
    from transformers import AutoConfig

    if name not in SHAPES:
        from ..errors import ConfigError

        raise ConfigError(f"unknown model shape '{name}'; choose one of: {', '.join(SHAPES)}")
    fields = dict(SHAPES[name])
    model_type = fields.pop("model_type")
    if layers:
        fields["num_hidden_layers"] = layers
    if hidden and hidden != fields["hidden_size"]:
        head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
        ratio = fields["num_attention_heads"] // fields["num_key_value_heads"]
        heads = max(2, hidden // head_dim)
        widths = {"intermediate_size": max(hidden, fields["intermediate_size"] * hidden // fields["hidden_size"])}
        if "moe_intermediate_size" in fields:  # a multiple of 32, as real models' expert widths are
            width = fields["moe_intermediate_size"] * hidden // fields["hidden_size"]
            widths["moe_intermediate_size"] = -(-width // 32) * 32
        fields.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=max(1, heads // ratio),
                      head_dim=head_dim, **widths)
    return AutoConfig.for_model(model_type, **fields)


def build(name: str, out: str | Path, *, layers: int | None = None, hidden: int | None = None, seed: int = 0,
          dtype: str = "bfloat16") -> Path:
    """Build a random-weight model of shape ``name`` into ``out`` (``save_pretrained``, sharded
    safetensors) with the embedded tokenizer beside it; returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .folder import save_pretrained, save_tokenizer
    from .tiny_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(quiet=True))
    config = shape_config(name, layers=layers, hidden=hidden)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out = Path(out)
    save_pretrained(model, out)
    save_tokenizer(tokenizer, out)
    return out
