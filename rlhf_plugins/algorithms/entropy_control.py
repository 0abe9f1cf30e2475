"""The entropy bonus's coefficient per step: fixed (``--algo.policy_loss.entropy_coef``), or adaptive
(Skywork-OR1; TRL's ``use_adaptive_entropy``) with ``--algo.policy_loss.entropy_target``. Its state is
part of a checkpoint."""
from __future__ import annotations

import math
from typing import Any


class FixedEntropyCoef:
    def __init__(self, value: float) -> None:
        self.coef = value

    @property
    def value(self) -> float:
        """The coefficient this step's bonus applies."""
        return self.coef

    def update(self, metrics: dict[str, float]) -> dict[str, float]:
        """After a step, from its metrics; returns what to log."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef = float(state["coef"])


class AdaptiveEntropyCoef(FixedEntropyCoef):
    """The bonus applies only while the measured entropy is at or below ``target`` (none before the
    first measurement); after each step the coefficient rises by ``delta`` (up to ``high``) when the
    step's entropy was at or below the target, and falls by ``delta`` (down to ``low``) otherwise."""

    def __init__(self, value: float, target: float, delta: float, low: float, high: float) -> None:
        super().__init__(value)
        self.target, self.delta, self.low, self.high = target, delta, low, high
        self.last = math.inf

    @property
    def value(self) -> float:
        return self.coef if self.last <= self.target else 0.0

    def update(self, metrics: dict[str, float]) -> dict[str, float]:
        applied = self.value
        entropy = metrics.get("entropy")
        if entropy is None:  # the actor did not train this step (the critic's warm-up)
            return {}
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        self.last = float(entropy)
        return {"entropy/coef": applied}

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef, self.last = float(state["coef"]), float(state.get("last", math.inf))


def make_entropy_coef(cfg: Any) -> FixedEntropyCoef:
    """From the policy-loss options."""
    if cfg.entropy_target is None:
        return FixedEntropyCoef(cfg.entropy_coef)
    return AdaptiveEntropyCoef(cfg.entropy_coef, cfg.entropy_target, cfg.entropy_coef_delta, cfg.entropy_coef_min,
                               cfg.entropy_coef_max)
