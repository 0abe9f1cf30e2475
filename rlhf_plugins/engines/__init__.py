"""Generation engines: prompts in, n sampled completions per prompt out."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class Samples:
    """Engine output, ``n`` consecutive samples per prompt in prompt order."""

    prompt_index: list[int] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    #: log-prob of each sampled token, log softmax(logits / temperature), as the learner computes it
    logprobs: list[list[float]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.completion_ids)
