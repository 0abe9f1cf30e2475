"""The plugins rlhf-plugins ships. They are registered from this explicit tuple
(not through our own entry points), so a source checkout works and ``rlhf plugins``
can tell builtin from third-party. Each can be blocked with ``--plugin no:NAME``.
"""
from __future__ import annotations

DEFAULT_PLUGINS: tuple[str, ...] = (
    "rlhf_plugins.builtin_plugins.models",
    "rlhf_plugins.builtin_plugins.placement_local",
    "rlhf_plugins.builtin_plugins.placement_ray",
    "rlhf_plugins.builtin_plugins.generation_transformers",
    "rlhf_plugins.builtin_plugins.generation_vllm",
    "rlhf_plugins.builtin_plugins.rewards",
    "rlhf_plugins.builtin_plugins.advantages",
    "rlhf_plugins.builtin_plugins.policy_losses",
    "rlhf_plugins.builtin_plugins.kl_estimators",
    "rlhf_plugins.builtin_plugins.learner_torch",
    "rlhf_plugins.builtin_plugins.learner_deepspeed",
    "rlhf_plugins.builtin_plugins.learner_fsdp",
    "rlhf_plugins.builtin_plugins.sync_inprocess",
    "rlhf_plugins.builtin_plugins.sync_broadcast",
    "rlhf_plugins.builtin_plugins.sync_adapter",
    "rlhf_plugins.builtin_plugins.lora",
    "rlhf_plugins.builtin_plugins.logging_backends",
    "rlhf_plugins.builtin_plugins.scheduling",
    "rlhf_plugins.builtin_plugins.environments",
)
