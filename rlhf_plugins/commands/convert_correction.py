"""OpenRLHF's off-policy correction of vLLM's rollouts, in both generations of its flags, as our mismatch
correction (``--algo.policy_loss.mismatch``, its band and ``tis_floor``).

0.9's flags: ``--enable_vllm_is_correction`` with ``--vllm_is_correction_type`` (tis, icepop, seq-mask-tis)
and ``--vllm_is_truncated_threshold LOW HIGH``; its TIS clamps a token's weight into the band from both
sides. Later releases (dotted flags) say it as a granularity and a treatment:
``--algo.advantage.is_correction_level`` (off, token, seq, geo; off by default) with
``--algo.advantage.is_correction_mode`` (mask, clip, trunc; mask by default) and a gate
(``--algo.advantage.is_correction_gating``, the ratio by default). One threshold value is the upper bound
alone. The flags are read together, as OpenRLHF's loss reads them."""
from __future__ import annotations

from typing import Any

ENABLE, TYPE, THRESHOLD = "--enable_vllm_is_correction", "--vllm_is_correction_type", "--vllm_is_truncated_threshold"
ICEPOP = "--use_icepop"  # 0.9's earlier spelling of --vllm_is_correction_type icepop
LEVEL, MODE, GATING = ("--algo.advantage.is_correction_level", "--algo.advantage.is_correction_mode",
                       "--algo.advantage.is_correction_gating")
#: the flags read here (their first spelling in the flag table)
FLAGS = (ENABLE, TYPE, THRESHOLD, ICEPOP, LEVEL, MODE, GATING)
#: OpenRLHF's band when no threshold is given
BAND = (0.5, 5.0)
#: 0.9's correction types: (ours, whether the band's low end is a floor of the weights)
TYPES = {"tis": ("tis", True), "icepop": ("icepop", False), "seq-mask-tis": ("seq_mask_tis", False)}
#: later releases' (level, mode): the same
SCHEMES = {("token", "mask"): ("icepop", False), ("token", "clip"): ("tis", True), ("token", "trunc"): ("tis", False),
           ("geo", "mask"): ("seq_mask_tis", False)}


def convert_correction(out: Any, given: dict[str, list[str]]) -> None:
    """The flags of ``FLAGS`` that ``given`` holds (by first spelling: their values) into ``out`` (a
    :class:`~.convert.Converted` of train_ppo_ray): the correction, its band and floor -- or, where OpenRLHF's
    scheme has no equivalent, the flags listed as not converted with the reason."""
    if not given:
        return
    band = _band(out, given.get(THRESHOLD))
    if any(flag in given for flag in (LEVEL, MODE, GATING)):
        scheme = _scheme(out, given)
    elif ENABLE in given and out.raw.get("algo", {}).get("policy_loss", {}).get("name", "ppo") != "ppo":
        out.skipped.append((ENABLE, "OpenRLHF 0.9 applies it to the ppo loss only: under another --policy_loss_type "
                                    "it corrects nothing, and nothing is converted"))
        return
    elif ENABLE in given:
        kind = "icepop" if ICEPOP in given else given.get(TYPE, ["tis"])[0]
        scheme = TYPES.get(kind)
        if scheme is None:
            out.skipped.append((TYPE, f"'{kind}' is not one of OpenRLHF's tis, icepop, seq-mask-tis"))
    else:  # a type or threshold without --enable_vllm_is_correction: no correction, as there
        out.skipped += [(flag, f"no effect without {ENABLE}, as in OpenRLHF") for flag in given]
        return
    if scheme is None:
        return
    name, floored = scheme
    out.put("algo.policy_loss.mismatch", name)
    if name == "none" and "train.max_staleness" in out.set_keys:  # --async_train with the correction off
        out.put("train.allow_uncorrected_staleness", True)  # OpenRLHF trains on stale samples uncorrected
    if name == "seq_mask_tis":
        flag = LEVEL if LEVEL in given else TYPE
        out.partial.append((flag, "seq_mask_tis here caps a kept sequence's token weights at the band's high end, "
                                  "where OpenRLHF keeps the raw ratio"))
    if name != "none":
        out.put("algo.policy_loss.mismatch_low", band[0])
        out.put("algo.policy_loss.mismatch_high", band[1])
        out.put("algo.policy_loss.tis_floor", band[0] if floored else 0.0)


def _band(out: Any, values: list[str] | None) -> tuple[float, float]:
    if values is None:
        return BAND
    try:
        bounds = [float(v) for v in values]
    except ValueError:
        bounds = []
    if len(bounds) == 1:
        return 0.0, bounds[0]
    if len(bounds) == 2:
        return bounds[0], bounds[1]
    out.skipped.append((THRESHOLD, f"expects LOW HIGH or one upper bound; got {' '.join(values) or 'nothing'} "
                                   f"(OpenRLHF's {BAND[0]} {BAND[1]} used)"))
    return BAND


def _scheme(out: Any, given: dict[str, list[str]]) -> tuple[str, bool] | None:
    level, mode = given.get(LEVEL, ["off"])[0], given.get(MODE, ["mask"])[0]
    gating = given.get(GATING, ["ratio"])[0]
    if level == "off":
        return "none", False
    if gating != "ratio":
        out.skipped.append((GATING, f"'{gating}' has no equivalent here: the gate is the importance ratio"))
        return None
    scheme = SCHEMES.get((level, mode))
    if scheme is None:
        out.skipped.append((LEVEL, f"level '{level}' with mode '{mode}' has no equivalent here (token mask, clip or "
                                   "trunc, and geo mask, do: icepop, tis, seq_mask_tis)"))
    return scheme
