"""OpenRLHF's off-policy correction of vLLM's rollouts, in both generations of its flags, as our mismatch
correction (``--algo.policy_loss.mismatch``, its band and ``tis_floor``). Under gspo OpenRLHF weighs nothing and
takes GSPO's sequence ratio against the engine's log-probs instead (our ``engine_ratio``).

0.9's flags: ``--enable_vllm_is_correction`` with ``--vllm_is_correction_type`` (tis, icepop, seq-mask-tis)
and ``--vllm_is_truncated_threshold LOW HIGH``; its TIS clamps a token's weight into the band from both
sides; its seq-mask-tis drops the sequences whose geometric-mean ratio leaves the band and keeps the raw
token ratios of the others (our seq_icepop). Later releases (dotted flags) say it as a granularity, a
treatment and a gate: ``--algo.advantage.is_correction_level`` (off, token, seq; off by default),
``--algo.advantage.is_correction_mode`` (mask, clip; mask by default; clip only per token on the ratio) and
``--algo.advantage.is_correction_gating`` (ratio, binary_kl, tv; a divergence gate takes an upper bound
alone). One threshold value is the upper bound alone. The flags are read together, as OpenRLHF's loss reads
them, and a combination its loss refuses is listed as not converted."""
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
TYPES = {"tis": ("tis", True), "icepop": ("icepop", False), "seq-mask-tis": ("seq_icepop", False)}
#: later releases' (level, mode): the same
SCHEMES = {("token", "mask"): ("icepop", False), ("token", "clip"): ("tis", True),
           ("seq", "mask"): ("seq_icepop", False)}
#: later releases' levels, modes and gates
LEVELS, MODES, GATES = ("off", "token", "seq"), ("mask", "clip"), ("ratio", "binary_kl", "tv")


def convert_correction(out: Any, given: dict[str, list[str]]) -> None:
    """The flags of ``FLAGS`` that ``given`` holds (by first spelling: their values) into ``out`` (a
    :class:`~.convert.Converted` of train_ppo_ray): the correction, its band and floor -- or, where OpenRLHF's
    scheme has no equivalent, the flags listed as not converted with the reason."""
    if not given:
        return
    band = _band(out, given.get(THRESHOLD))
    dotted = any(flag in given for flag in (LEVEL, MODE, GATING))
    loss = out.raw.get("algo", {}).get("policy_loss", {}).get("name", "ppo")
    if (ENABLE in given or dotted and given.get(LEVEL, ["off"])[0] != "off") and loss != "ppo":
        # under gspo OpenRLHF weighs nothing: its sequence ratio is taken against the engine's log-probs instead
        out.put("algo.policy_loss.mismatch", "engine_ratio")
        out.partial.append((LEVEL if dotted else ENABLE, "under gspo: GSPO's ratio against the engine's log-probs "
                                                         "(engine_ratio), as there; the type, mode and band unused"))
        return
    if dotted:
        scheme = _scheme(out, given, band)
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
    gated = out.raw.get("algo", {}).get("policy_loss", {}).get("mismatch_gate", "ratio") != "ratio"
    if name != "none" and not gated:  # a divergence gate has its own bound (mismatch_max_divergence)
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


def _scheme(out: Any, given: dict[str, list[str]], band: tuple[float, float]) -> tuple[str, bool] | None:
    level, mode = given.get(LEVEL, ["off"])[0], given.get(MODE, ["mask"])[0]
    gating = given.get(GATING, ["ratio"])[0]
    for flag, value, choices in ((LEVEL, level, LEVELS), (MODE, mode, MODES), (GATING, gating, GATES)):
        if value not in choices:
            out.skipped.append((flag, f"'{value}' is not one of OpenRLHF's {', '.join(choices)}"))
            return None
    if level == "off":
        return "none", False
    if mode == "clip" and (level != "token" or gating != "ratio"):
        out.skipped.append((MODE, "clip needs --algo.advantage.is_correction_level token and the ratio gate; "
                                  "OpenRLHF refuses this combination too"))
        return None
    if gating != "ratio":
        if band[0] > 0:
            out.skipped.append((GATING, f"a {gating} gate takes an upper bound alone (one "
                                        "--algo.advantage.is_correction_threshold value); OpenRLHF refuses the band "
                                        f"{band[0]} {band[1]} too"))
            return None
        out.put("algo.policy_loss.mismatch_gate", gating)
        out.put("algo.policy_loss.mismatch_max_divergence", band[1])
        return SCHEMES[(level, mode)][0], False
    return SCHEMES[(level, mode)]
