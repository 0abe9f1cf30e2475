"""What ``trl grpo --config FILE``'s script arguments become: ``reward_funcs`` entries -- the names TRL's
script knows without an import path (its reward registry: ``trl.rewards``) or ``module.function`` -- and
``reward_model_name_or_path`` (a reward model, first among TRL's reward sources)."""
from __future__ import annotations

from typing import Any

from ..config.loading import set_dotted as _set
from ..errors import ConfigError
from .trl_open_r1 import OPEN_R1_REWARDS, open_r1_reward

#: reward names `trl grpo` resolves itself (trl/scripts/grpo.py's registry) -> the module defining each
TRL_REGISTRY = {"accuracy_reward": "trl.rewards.accuracy_rewards",
                "reasoning_accuracy_reward": "trl.rewards.accuracy_rewards",
                "think_format_reward": "trl.rewards.format_rewards"}


def script_rewards(script: dict[str, Any], raw: dict[str, Any]) -> list[str]:
    """Sets the run's reward functions and models (``reward_weights`` reordered from TRL's order -- the
    model, then the functions -- to ours: functions, then models); returns the plugins to load."""
    funcs = script.get("reward_funcs") or []
    funcs = [funcs] if isinstance(funcs, str) else list(funcs)
    plugins, names = [], []
    for spec in map(str, funcs):
        module, _, func = spec.rpartition(".")
        if spec in TRL_REGISTRY:
            module, func = TRL_REGISTRY[spec], spec
        elif not module and (open_r1 := open_r1_reward(spec)):
            module, func = open_r1
        elif spec == "get_soft_overlong_punishment":
            raise ConfigError("TRL reward 'get_soft_overlong_punishment' (DAPO's, against 1280 tokens with a 256-token "
                              "cache in TRL's script) is --reward.overlong_buffer N --reward.overlong_penalty 1 here, "
                              "against generation.max_new_tokens; remove it from reward_funcs and set those")
        elif not module:
            raise ConfigError(f"TRL reward_funcs entry '{spec}' must be 'module.function' or one of TRL's: "
                              f"{', '.join(TRL_REGISTRY)}, or open-r1's: {', '.join(OPEN_R1_REWARDS)} (another "
                              "script's names are that script's to resolve: give the function's import path, or run "
                              "the script itself with `from rlhf_plugins.integrations.trl import GRPOTrainer`)")
        plugins.append(module)
        names.append(func)
    if names:
        _set(raw, "reward.functions", names)
    model = script.get("reward_model_name_or_path")
    if model:
        _set(raw, "reward.models", [str(model)])
        weights = raw.get("reward", {}).get("weights") or []
        if weights and len(weights) != len(names) + 1:
            raise ConfigError(f"TRL reward_weights has {len(weights)} values for {len(names) + 1} reward sources "
                              "(reward_model_name_or_path, then reward_funcs); give one each")
        if weights:  # TRL's first weight is the model's
            _set(raw, "reward.weights", [*weights[1:], weights[0]])
    return list(dict.fromkeys(plugins))
