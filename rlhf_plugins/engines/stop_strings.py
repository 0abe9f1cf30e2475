"""Stop strings for an engine that samples token by token: a completion ends once its text contains
one of ``SamplingParams.stop``, with the token that completed it kept -- what vLLM's ``stop`` does
(text decoded without special tokens, as vLLM's detokenizer skips them by default)."""
from __future__ import annotations

from typing import Any

import torch


class StopStrings:
    """Checks the newest tokens of each sample: only a window at the end is decoded each step (wide
    enough to hold the longest stop string even at one character a token), so a step costs the same
    however long the completion is."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.window = 2 * max((len(s) for s in self.stop), default=0) + 4

    def __bool__(self) -> bool:
        return bool(self.stop)

    def hit(self, tokens: torch.Tensor, t: int, active: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: the samples (of ``active``) whose text now holds a stop string, ``tokens[:, :t + 1]``
        being their completions so far."""
        out = torch.zeros_like(active)
        rows = active.nonzero().flatten().tolist()
        if not rows:
            return out
        tails = tokens[rows, max(0, t + 1 - self.window): t + 1].tolist()
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        for row, text in zip(rows, texts):
            if any(s in text for s in self.stop):
                out[row] = True
        return out
