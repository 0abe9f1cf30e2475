"""The order prompts are trained in: seeded epochs, its position part of a checkpoint."""
from __future__ import annotations

import math


def steps_for_episodes(episodes: float, prompts: int, per_step: int) -> int:
    """Rollout steps for ``episodes`` passes over ``prompts`` prompts, ``per_step`` a step (at least one; a
    last partial step takes its remaining prompts from the next pass)."""
    return max(1, math.ceil(episodes * prompts / per_step))


class PromptSampler:
    """Seeded epochs over the prompt set; its position is part of a checkpoint."""

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        import torch

        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.cursor >= self.size:
                self.epoch += 1
                self.cursor = 0
                self._order = self._permutation()
            step = min(k - len(out), self.size - self.cursor)
            out.extend(self._order[self.cursor : self.cursor + step])
            self.cursor += step
        return out

    def passes(self, before: int = 0) -> float:
        """Passes over the prompt set drawn so far (TRL's ``epoch``; 1.5: one pass and half the next), or
        before the last ``before`` prompts drawn."""
        return max(0.0, self.epoch + (self.cursor - before) / max(1, self.size))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._permutation()
