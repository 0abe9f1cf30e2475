"""Held-out figures of the stages: exact-match evaluation of a saved policy."""
from __future__ import annotations

from typing import Any


def evaluate_model(path: str, rows: list[dict[str, Any]], n: int = 8, temperature: float = 1.0,
                   max_new_tokens: int = 8, seed: int = 0, prompt_key: str = "prompt",
                   label_key: str = "label") -> dict[str, float]:
    """Exact-match evaluation of a saved policy (``save_pretrained`` folder) on ``rows``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..builtin_plugins.rewards import exact_match
    from ..config.schema import Config, DataConfig
    from ..data.prompts import load_prompts
    from ..engines.transformers_engine import TransformersEngine
    from ..evaluation.evaluator import EvalSettings, Evaluator
    from ..evaluation.metrics import extract_answer
    from ..protocols import BackendContext

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    def load() -> object:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False)

    ctx = BackendContext(Config(), "generation", path, load)
    data = DataConfig(prompt_key=prompt_key, label_key=label_key,
                      apply_chat_template=bool(getattr(tokenizer, "chat_template", None)), max_prompt_tokens=10**9)
    prompts = load_prompts(data, tokenizer, rows=rows)
    settings = EvalSettings(n_samples=n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)

    labels = prompts.columns["label"]

    def score(index: list[int], samples: Any, texts: list[str], step: int, extra: Any) -> list[float]:
        return exact_match([prompts.prompts[i] for i in index], texts, label=[labels[i] for i in index])

    evaluator = Evaluator(prompts, tokenizer, TransformersEngine(ctx), score, lambda text, row: extract_answer(text),
                          settings)
    return evaluator()
