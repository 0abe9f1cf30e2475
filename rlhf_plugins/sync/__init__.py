"""Weight sync: moving the actor's new weights into the generation engine."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import UsageError

if TYPE_CHECKING:
    import torch


class SyncParityError(UsageError):
    """The engine's log-probs disagree with the learner's after a sync."""


def parity_tolerance(vocab: int) -> float:
    """How far two correct float32 implementations' log-probs may drift apart: 1e-4, or more for a
    large vocabulary, whose log-softmax sums ``vocab`` terms in an order each kernel picks (rounding
    grows like sqrt(vocab) ulps; 16 of them as margin). 1e-4 up to a 48k vocabulary, 7.5e-4 at 152k."""
    return max(1e-4, 16 * vocab**0.5 * 2.0**-23)


def folder_tolerance(model_path: str, trust_remote_code: bool = False) -> float:
    """:func:`parity_tolerance` for the vocabulary of the model in the folder at ``model_path``."""
    from ..models.memory import ModelShape

    return parity_tolerance(ModelShape.of_folder(model_path, trust_remote_code).vocab)


def verify_parity(actor: Any, engine: Any, probe: dict[str, torch.Tensor], tol: float = 1e-4) -> float:
    """Max |engine log-prob - learner log-prob| over the probe's completion tokens."""
    mask = probe["action_mask"].bool()
    a = actor.logprobs(probe)
    e = engine.logprobs(probe)
    diff = float((a - e).abs()[mask].max()) if mask.any() else 0.0
    if diff > tol:
        raise SyncParityError(
            f"weight sync parity failed: engine and learner log-probs differ by {diff:.2e} (> {tol:.1e}); if the "
            "engine computes this architecture with code of its own (vLLM's implementation of it), "
            "--vllm.model_impl transformers runs the learner's transformers code in the engine"
        )
    return diff
