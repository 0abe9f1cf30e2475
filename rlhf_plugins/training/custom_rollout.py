"""A step's samples from a plugin's ``rlhf_rollout`` (how TRL's ``rollout_func`` runs), checked and
turned into a :class:`~.rollout.Rollout`."""
from __future__ import annotations

from typing import Any

from ..errors import UsageError
from .rollout import Rollout

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
WHO = "the rlhf_rollout hook (TRL's rollout_func)"


def _ints(rows: Any, key: str) -> list[list[int]]:
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in rows):
        raise UsageError(f"{WHO} returned '{key}' of type {type(rows).__name__}; give a list of token-id lists")
    return [[int(t) for t in r] for r in rows]


def custom_rollout(trainer: Any, idx: list[int], params: Any, out: Any) -> Rollout:
    n, P = params.n, len(idx)
    B = n * P
    if not isinstance(out, dict) or any(k not in out for k in REQUIRED):
        have = ", ".join(map(str, out)) if isinstance(out, dict) else type(out).__name__
        raise UsageError(f"{WHO} must return a dict with {', '.join(REQUIRED)}; it returned {have}")
    prompt_ids = _ints(out["prompt_ids"], "prompt_ids")
    if len(prompt_ids) == P:
        prompt_ids = [p for p in prompt_ids for _ in range(n)]
    completion_ids = _ints(out["completion_ids"], "completion_ids")
    if len(prompt_ids) != B or len(completion_ids) != B:
        raise UsageError(f"{WHO} returned {len(completion_ids)} completions and {len(prompt_ids)} prompts for {P} "
                         f"prompts x {n} generations; return {n} completions per prompt (prompt_ids once per prompt "
                         "or once per completion)")
    logprobs = [[float(x) for x in row] for row in out["logprobs"]]
    masks = [[int(m) for m in row] for row in out["env_mask"]] if out.get("env_mask") is not None else []
    for i, c in enumerate(completion_ids):
        if len(logprobs[i]) != len(c) or (masks and len(masks[i]) != len(c)):
            raise UsageError(f"{WHO}: completion {i} has {len(c)} tokens but {len(logprobs[i])} logprobs"
                             + (f" and {len(masks[i])} env_mask values" if masks else "") + "; give one per token")
    eos = trainer.tokenizer.eos_token_id
    reasons = list(out.get("finish_reasons") or ["stop" if c and c[-1] == eos else "length" for c in completion_ids])
    p = trainer.prompts
    per_sample = [i for i in idx for _ in range(n)]
    columns = {k: [v[i] for i in per_sample] for k, v in p.columns.items()}
    for key, value in out.items():
        if key not in (*REQUIRED, "env_mask", "finish_reasons", "logprob_token_ids"):
            if not isinstance(value, (list, tuple)) or len(value) != B:
                raise UsageError(f"{WHO} returned '{key}', which is not one value per completion ({B})")
            columns[key] = list(value)
    return Rollout(
        prompts=[p.prompts[i] for i in per_sample],
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        completions=trainer.tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
        finish_reasons=reasons,
        rollout_logprobs=logprobs,
        columns=columns,
        group_size=n,
        versions=[[trainer.engine_version] * len(c) for c in completion_ids],
        action_masks=masks,
    )
