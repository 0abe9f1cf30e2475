"""KL coefficient controllers; their state is part of a checkpoint."""
from __future__ import annotations

from typing import Any


class FixedKLController:
    def __init__(self, value: float) -> None:
        self.value = value

    def update(self, current_kl: float, n_samples: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. (2019): move the coefficient so the measured KL approaches ``target``;
    the error is clipped to +-20% and scaled by ``n_samples / horizon`` per update."""

    def __init__(self, value: float, target: float, horizon: int) -> None:
        super().__init__(value)
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_samples: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon


def make_controller(cfg: Any) -> FixedKLController:
    if cfg.controller == "adaptive":
        return AdaptiveKLController(cfg.coef, cfg.target, cfg.horizon)
    return FixedKLController(cfg.coef)
