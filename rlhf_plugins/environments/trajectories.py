"""What a step's multi-turn rollout gives back: per trajectory, its tokens (the model's and the
environment's), log-probs, finish reason, messages and the environment's reward and scores, and the
metrics they make."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..rewards.callables import log_extra

FINISH_REASONS = ("stop", "length", "max_turns", "env_done")


@dataclass
class Trajectories:
    """Per trajectory, in the order of the samples (``n`` consecutive per prompt)."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    #: every token after the prompt: model turns and environment output
    completion_ids: list[list[int]] = field(default_factory=list)
    #: 1 on the model's tokens, 0 on the environment's
    action_masks: list[list[int]] = field(default_factory=list)
    #: engine log-prob of each model token (0.0 on environment tokens)
    logprobs: list[list[float]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    #: the text of each trajectory's last model turn (what answer-checking rewards read)
    final_texts: list[str] = field(default_factory=list)
    #: the trajectory as chat messages (assistant turns, tool / environment replies)
    messages: list[list[dict[str, Any]]] = field(default_factory=list)
    #: the environment's own reward (get_reward, an agent's summed rewards); None where it has none
    env_rewards: list[float | None] = field(default_factory=list)
    #: an OpenRLHF agent's ``scores`` (None for other environments): what dynamic filtering compares
    env_scores: list[float | None] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    tool_failures: list[int] = field(default_factory=list)
    #: an OpenRLHF agent's ``extra_logs`` of its last step (None for other environments)
    extra_logs: list[Any] = field(default_factory=list)
    #: prompt tokens of the turns after the first, and how many of them the engine's prefix cache
    #: served (None: the engine does not say)
    later_prompt_tokens: int = 0
    later_cached_tokens: int | None = None

    def metrics(self) -> dict[str, float]:
        n = max(len(self.turns), 1)
        calls = sum(self.tool_calls)
        env_tokens = sum(len(m) - sum(m) for m in self.action_masks)
        out = {
            "env/turns": sum(self.turns) / n,
            "env/tool_call_rate": sum(c > 0 for c in self.tool_calls) / n,
            "env/tool_calls": calls / n,
            "env/tool_failures": float(sum(self.tool_failures)),
            "env/tool_failure_rate": sum(self.tool_failures) / calls if calls else 0.0,
            "env/env_tokens": env_tokens / n,
        }
        for reason in FINISH_REASONS:
            out[f"env/finish_{reason}"] = sum(r == reason for r in self.finish_reasons) / n
        if self.later_cached_tokens is not None and self.later_prompt_tokens:
            out["env/prefix_cache_hit_rate"] = self.later_cached_tokens / self.later_prompt_tokens
        logged: dict[str, list[float]] = {}
        for extra in self.extra_logs:  # by their own names, as OpenRLHF logs them
            log_extra(extra, lambda name, value: logged.setdefault(name, []).append(value))
        out.update({name: sum(values) / len(values) for name, values in logged.items()})
        return out
