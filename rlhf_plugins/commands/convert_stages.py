"""OpenRLHF's stage commands (``train_sft``, ``train_rm``, ``train_dpo``) as TRL fields: the flags that
become several of TRL's fields at once, and the optimizer settings OpenRLHF's stage trainers run with
by default where TRL's differ (a global batch of 128, cosine decay to a tenth of the learning rate
after a 3% warm-up, Adam betas (0.9, 0.95), and each stage's learning rate, epochs and sequence length) --
carried, so that a converted run trains as OpenRLHF's."""
from __future__ import annotations

from typing import Any

STAGES = ("sft", "rm", "dpo")
#: TRL's per-device batch when --micro_train_batch_size is not given
TRL_PER_DEVICE = 8
#: OpenRLHF's defaults in train_sft / train_rm / train_dpo (0.9-0.11) of the flags converted here
DEFAULTS: dict[str, list[str]] = {
    "--train_batch_size": ["128"],
    "--lr_scheduler": ["cosine_with_min_lr"],
    "--min_lr_ratio": ["0.1"],
    "--lr_warmup_ratio": ["0.03"],
    "--adam_betas": ["0.9", "0.95"],
}
#: OpenRLHF's per-stage defaults (0.9-0.11) of flags that TRL's fields take as they are, where TRL's (and the
#: stages' own 256-token bound) differ: (flag, TRL field) -> value per stage
PER_STAGE = {("--learning_rate", "trl.learning_rate"): {"sft": 5e-6, "rm": 9e-6, "dpo": 1e-5},
             ("--max_epochs", "trl.num_train_epochs"): {"sft": 2, "rm": 1, "dpo": 1},
             ("--max_len", "trl.max_length"): {"sft": 2048, "rm": 512, "dpo": 512}}
#: flags converted here (their first spelling in the flag table), with the defaults above
BY_HAND = (*DEFAULTS, "--nll_loss_coef")
SCHEDULERS = {"cosine_with_min_lr": "cosine_with_min_lr", "cosine": "cosine", "linear": "linear",
              "constant": "constant", "constant_with_warmup": "constant_with_warmup"}


def convert_stage(out: Any, given: dict[str, list[str]]) -> None:
    """The flags of ``BY_HAND`` that ``given`` holds (by first spelling: their values), OpenRLHF's
    defaults for the others, into ``out`` (a :class:`~.convert.Converted` of a stage command)."""
    values = {**DEFAULTS, **given}
    for flag, default in DEFAULTS.items():
        if flag not in given and flag != "--train_batch_size":  # the batch says how it is carried itself
            out.carried.append(f"{flag} {' '.join(default)}")
    _batch(out, int(float(values["--train_batch_size"][0])), "--train_batch_size" in given)
    scheduler = values["--lr_scheduler"][0]
    if scheduler not in SCHEDULERS:
        out.skipped.append(("--lr_scheduler", f"'{scheduler}' has no TRL equivalent; TRL's linear decay runs"))
    else:
        out.put("trl.lr_scheduler_type", SCHEDULERS[scheduler])
        if scheduler == "cosine_with_min_lr":
            out.put("trl.lr_scheduler_kwargs", {"min_lr_rate": float(values["--min_lr_ratio"][0])})
    out.put("trl.warmup_steps", float(values["--lr_warmup_ratio"][0]))  # below 1: a ratio (transformers 5)
    beta1, beta2 = (float(v) for v in values["--adam_betas"][:2])
    out.put("trl.adam_beta1", beta1)
    out.put("trl.adam_beta2", beta2)
    for (flag, key), value in PER_STAGE.items():
        if key not in out.set_keys:
            out.put(key, value[out.command])
            out.carried.append(f"{flag} {value[out.command]:g}")
    nll = float(given.get("--nll_loss_coef", ["0"])[0])
    if nll and out.command == "dpo":  # RPO: the preference loss plus the chosen answers' NLL
        loss = out.raw.get("trl", {}).get("loss_type", "sigmoid")
        out.put("trl.loss_type", [*([loss] if isinstance(loss, str) else loss), "sft"])
        out.put("trl.loss_weights", [1.0, nll])
        out.partial.append(("--nll_loss_coef", f"TRL's loss_type {out.raw['trl']['loss_type']} with loss_weights "
                                               f"[1.0, {nll:g}] (the chosen answers' NLL, RPO)"))


def _batch(out: Any, total: int, given: bool) -> None:
    """OpenRLHF's global batch as TRL's per-device batch x ``gradient_accumulation_steps`` on one process."""
    per_device = int(out.raw.get("trl", {}).get("per_device_train_batch_size") or TRL_PER_DEVICE)
    steps = max(1, round(total / per_device))
    out.put("trl.per_device_train_batch_size", per_device)
    out.put("trl.gradient_accumulation_steps", steps)
    how = (f"{total} samples per optimizer step: {per_device} per device x {steps} accumulation steps "
           "(trl.gradient_accumulation_steps) on one process; under accelerate launch with N processes, divide "
           "trl.gradient_accumulation_steps by N")
    if given:
        out.partial.append(("--train_batch_size", how))
    else:
        out.carried.insert(0, f"--train_batch_size {total} ({how})")


def stage_key(key: str) -> bool:
    """Whether a stage's config has ``key`` (``trl.*``: TRL's fields, checked when the stage runs)."""
    import dataclasses

    from ..stages.config import StageConfig

    section, _, name = key.partition(".")
    if section == "trl":
        return True
    sections = {f.name: f.default_factory for f in dataclasses.fields(StageConfig)}
    factory = sections.get(section)
    return callable(factory) and name in {f.name for f in dataclasses.fields(factory())}
