"""Defaults by model size.

The embedded tiny model (0.4M parameters) learns its task in a minute at ``learner.lr 5e-4`` (at
1e-3 it learned faster on most seeds but drifted away from its reference on some: KL above 7 and
answers that no longer stop). A real model at that rate is wrecked by its
first update: AdamW moves every weight by about ``lr`` however small the gradient (measured on a
494M-parameter Qwen2.5 shape: KL 0.33 to the reference after one update whose advantages were all
zero). So a model of :data:`REAL_MODEL_PARAMETERS` or more gets what OpenRLHF and TRL users run with,
for every one of these keys the run does not set itself; the printed config says so.
"""
from __future__ import annotations

import logging
from typing import Any

#: a model this large (parameters) is trained with :data:`REAL_MODEL_DEFAULTS`
REAL_MODEL_PARAMETERS = 50_000_000
#: OpenRLHF's PPO defaults (actor 1e-6 -- TRL's GRPO default too --, critic 9e-6, 3% warm-up,
#: cosine decay to a tenth) and TRL's GRPO default of gradient checkpointing (activations are most of
#: a real model's training memory after its sharded states: 1.1 of 6.3 GB per ZeRO-3 rank at 0.5B)
REAL_MODEL_DEFAULTS: dict[str, Any] = {
    "learner.lr": 1e-6,
    "critic.lr": 9e-6,
    "learner.warmup_ratio": 0.03,
    "learner.lr_scheduler": "cosine",
    "learner.min_lr_ratio": 0.1,
    "learner.gradient_checkpointing": True,
}
#: the embedded model's task, whose answer is one number and EOS: ``exact_match`` reads the first
#: number of a completion, so without a cost for running on, some runs drift into answers that never
#: stop (``7=10=...``: KL above 3 to the reference, every completion at max_new_tokens) while the
#: reward still rises; the built-in default run charges them this (``reward.stop_penalty``)
EMBEDDED_TASK_STOP_PENALTY = 1.0
#: a mean per-token KL to the reference above this after the first update means the rate is too high
FIRST_UPDATE_KL = 0.05


def given_keys(raw: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted keys the user's YAML / flags / dict set."""
    out: set[str] = set()
    for key, value in raw.items():
        out.add(f"{prefix}{key}")
        if isinstance(value, dict):
            out |= given_keys(value, f"{prefix}{key}.")
    return out


def apply_scale_defaults(config: Any, raw: dict[str, Any]) -> str | None:
    """Set the real-model defaults the run leaves unset when its model is large (the embedded model on
    its own task: its stop penalty); return the note to print (None when nothing changed)."""
    if config.reward.stop_penalty is None:
        embedded = (not config.model.path and not config.env.name
                    and config.data.path in (None, "builtin:addition-train"))
        config.reward.stop_penalty = EMBEDDED_TASK_STOP_PENALTY if embedded else 0.0
    if not config.model.path:
        return None
    given = given_keys(raw)
    missing = {k: v for k, v in REAL_MODEL_DEFAULTS.items() if k not in given}
    if "learner.warmup_steps" in given:
        missing.pop("learner.warmup_ratio", None)
    if not missing:
        return None
    from ..models.memory import ModelShape

    parameters = ModelShape.of_folder(config.model.path, config.model.trust_remote_code).parameters
    if parameters < REAL_MODEL_PARAMETERS:
        return None
    for key, value in missing.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    chosen = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {str(v).lower()}" for k, v in missing.items())
    return (f"defaults for a {parameters / 1e6:.0f}M-parameter model (OpenRLHF's and TRL's, not the tiny default "
            f"model's): {chosen}; set any of them to override")


def warn_first_update(kl: float, config: Any) -> str | None:
    """One warning line when the first update moved a real-size model too far from the reference
    (the tiny default model moves further by design: its rate is tuned for a minute-long run)."""
    lr = config.learner.lr
    if kl <= FIRST_UPDATE_KL or not config.model.path:
        return None
    from ..models.memory import ModelShape

    if ModelShape.of_folder(config.model.path, config.model.trust_remote_code).parameters < REAL_MODEL_PARAMETERS:
        return None
    message = (f"KL to the reference is {kl:.3f} after the first update (above {FIRST_UPDATE_KL}): learner.lr {lr:g} "
               f"is likely too high for this model; OpenRLHF and TRL train real models at about 1e-6")
    logging.getLogger("rlhf_plugins").warning(message)
    return message
