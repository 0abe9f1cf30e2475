"""TRL's optimizer fields as its Trainer reads them: ``optim`` (with ``optim_args``, the ``key=value,...`` text
transformers hands some optimizers), the betas, the learning-rate schedule and its warm-up."""
from __future__ import annotations

from typing import Any

from ..config.loading import set_dotted as _set
from ..errors import ConfigError
from .trl_fields import ADAMW_STORED_OTHERWISE, OPTIMIZERS, SCHEDULERS

#: optims whose ``optim_args`` choose how the states are stored (torchao's quantised AdamW)
STORAGE_ARGS = {"adamw_torch_4bit": ("block_size", "bf16_stochastic_round"),
                "adamw_torch_8bit": ("block_size", "bf16_stochastic_round")}


def parse_optim_args(text: Any) -> dict[str, str]:
    """``optim_args`` as transformers parses it: ``key=value`` pairs, comma-separated, spaces dropped."""
    pairs = [part for part in str(text or "").replace(" ", "").split(",") if part]
    bad = [part for part in pairs if part.count("=") != 1]
    if bad:
        raise ConfigError(f"TRL optim_args '{text}' is not key=value pairs separated by commas (at '{bad[0]}')")
    return dict(part.split("=") for part in pairs)


def optimizer(f: dict[str, Any], raw: dict[str, Any], notes: list[str]) -> None:
    """Optimizer and schedule, as TRL's Trainer would run them (its default decays linearly)."""
    # a GRPOConfig object holds enums (SchedulerType.CONSTANT); YAML holds their values
    optim, schedule = (str(getattr(f[k], "value", f[k])) for k in ("optim", "lr_scheduler_type"))
    given = optim
    if optim in ADAMW_STORED_OTHERWISE:
        notes.append(f"TRL optim '{optim}' runs as torch's AdamW with float32 states: the same update up to the "
                     f"rounding of the states '{optim}' {ADAMW_STORED_OTHERWISE[optim]} (memory differs)")
        optim = "adamw_torch"
    if optim not in OPTIMIZERS:
        raise ConfigError(f"TRL optim '{optim}' has no equivalent; choose one of: {', '.join(OPTIMIZERS)}")
    if schedule not in SCHEDULERS:
        raise ConfigError(f"TRL lr_scheduler_type '{schedule}' has no equivalent; choose one of: "
                          f"{', '.join(SCHEDULERS)}")
    _set(raw, "learner.optimizer", OPTIMIZERS[optim])
    _set(raw, "learner.betas", [float(f["adam_beta1"]), float(f["adam_beta2"])])
    _set(raw, "learner.lr_scheduler", SCHEDULERS[schedule])
    kwargs = f.get("lr_scheduler_kwargs") or {}
    if schedule == "cosine_with_min_lr":
        ratio = kwargs.get("min_lr_rate")
        if ratio is None and kwargs.get("min_lr") is not None:
            ratio = float(kwargs["min_lr"]) / float(f["learning_rate"])
        _set(raw, "learner.min_lr_ratio", float(ratio or 0.0))
    warmup = float(f.get("warmup_steps") or 0)
    if 0 < warmup < 1:  # transformers 5 reads a warmup_steps below 1 as a ratio
        _set(raw, "learner.warmup_ratio", warmup)
    else:
        _set(raw, "learner.warmup_steps", int(warmup))
    _optim_args(given, f.get("optim_args"), raw, notes)


def _optim_args(optim: str, text: Any, raw: dict[str, Any], notes: list[str]) -> None:
    """SGD's momentum lands on ``learner.momentum``; what the Trainer reads for no optimizer here is a note."""
    args = parse_optim_args(text)
    if not args:
        return
    if optim != "sgd":
        reads = STORAGE_ARGS.get(optim, ())
        why = (f"its {' and '.join(reads)} choose how '{optim}' stores AdamW's states" if reads else
               f"TRL's Trainer does not pass it to optim '{optim}'")
        notes.append(f"TRL optim_args '{text}' is ignored: {why}")
        return
    if _number(args, "dampening", text) or args.get("nesterov", "false").lower() in ("true", "1", "yes"):
        raise ConfigError(f"TRL optim_args '{text}': SGD's dampening and nesterov have no equivalent here "
                          "(--learner.momentum is plain heavy-ball momentum); leave them out")
    if "momentum" in args:
        _set(raw, "learner.momentum", _number(args, "momentum", text))
    ignored = sorted(set(args) - {"momentum", "dampening", "nesterov"})
    if ignored:
        notes.append(f"TRL optim_args {', '.join(ignored)} ignored as TRL's Trainer ignores them for SGD "
                     "(weight_decay: its param groups set it from weight_decay)")


def _number(args: dict[str, str], key: str, text: Any) -> float:
    try:
        return float(args.get(key, 0))
    except ValueError:
        raise ConfigError(f"TRL optim_args '{text}': {key} expects a number; got '{args[key]}'") from None
