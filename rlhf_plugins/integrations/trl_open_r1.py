"""open-r1's GRPO recipes (``recipes/<model>/grpo/config_*.yaml``, read by its ``src/open_r1/grpo.py``) are TRL
GRPO files plus fields of open-r1's own: its GRPOConfig's (system prompt, chat template, hub and W&B
bookkeeping) and its script's (the prompt column, the settings of its reward factories). ``rlhf train
--trl-config`` reads them through :func:`open_r1_fields`; the reward names its registry resolves without an
import path map to its functions through :data:`OPEN_R1_REWARDS` (open-r1 installed, as its users have it)."""
from __future__ import annotations

from typing import Any

from ..config.loading import set_dotted
from ..errors import ConfigError

#: open-r1's reward names that are plain functions of ``open_r1.rewards``
OPEN_R1_REWARDS = {"accuracy": "accuracy_reward", "format": "format_reward",
                   "reasoning_steps": "reasoning_steps_reward", "length": "len_reward", "tag_count": "tag_count_reward"}
#: open-r1's reward names its script builds from its own fields (factories and partials)
OPEN_R1_BUILT = {"cosine": "cosine_*", "repetition_penalty": "repetition_n_grams and repetition_max_penalty",
                 "code": "parallel_code_exec_per_proc and e2b_router_url",
                 "binary_code": "parallel_code_exec_per_proc and e2b_router_url",
                 "ioi_code": "code_eval_test_batch_size", "code_format": "code_language",
                 "soft_overlong_punishment": "max_completion_len and soft_punish_cache"}
#: open-r1 fields (and one of transformers 4 its recipes hold) that change nothing here, and why
IGNORED = {
    "benchmarks": "run lighteval on final/ after training",
    "callbacks": "open-r1's callbacks push to the Hub; plugins observe a run here (docs/plugins.md)",
    "hub_model_revision": "nothing is pushed to the Hub",
    "overwrite_hub_revision": "nothing is pushed to the Hub",
    "push_to_hub_revision": "nothing is pushed to the Hub",
    "wandb_entity": "metrics go to the run directory; --log.wandb true --log.wandb_entity NAME adds W&B",
    "wandb_project": "metrics go to the run directory; --log.wandb true --log.wandb_project NAME adds W&B",
    "wandb_run_group": "metrics go to the run directory; --log.wandb true adds W&B",
    "dataset_mixture": "give one dataset_name, or --data.path with --data.probs",
    # transformers 4's TrainingArguments field (gone in 5), in open-r1's recipes and older TRL files
    "overwrite_output_dir": "every run writes a run directory of its own",
}
#: the settings of open-r1's built rewards, read by its script only
FACTORY_FIELDS = ("cosine_min_value_wrong", "cosine_max_value_wrong", "cosine_min_value_correct",
                  "cosine_max_value_correct", "cosine_max_len", "repetition_n_grams", "repetition_max_penalty",
                  "code_language", "code_eval_test_batch_size", "parallel_code_exec_per_proc", "e2b_router_url",
                  "code_provider", "ioi_provider", "max_completion_len", "soft_punish_cache")


def open_r1_fields(data: dict[str, Any], raw: dict[str, Any], notes: list[str]) -> None:
    """Moves open-r1's fields out of ``data`` (a TRL GRPO file's fields) onto ``raw``, a note for each it ignores.
    open-r1's script makes every row a conversation (the system prompt, then the prompt column as the user's
    message), so prompts are rendered by the chat template when its prompt column or system prompt is given."""
    conversation = False
    if "dataset_prompt_column" in data:
        set_dotted(raw, "data.prompt_key", str(data.pop("dataset_prompt_column")))
        conversation = True
    if (system := data.pop("system_prompt", None)) is not None:
        set_dotted(raw, "data.system_prompt", str(system))
        conversation = True
    if (template := data.pop("chat_template", None)) is not None:
        set_dotted(raw, "data.chat_template", str(template))
    if conversation:
        set_dotted(raw, "data.template_strings", True)
    for key in [k for k in data if k in IGNORED]:
        data.pop(key)
        notes.append(f"field '{key}' (open-r1's, or transformers 4's) is ignored: {IGNORED[key]}")
    factory = [k for k in data if k in FACTORY_FIELDS]
    for key in factory:
        data.pop(key)
    if factory:
        notes.append(f"open-r1 fields {', '.join(factory)} are ignored: they configure rewards its script builds "
                     "(cosine, repetition_penalty, code...), which run with its own script (docs/from_trl.md)")


def open_r1_reward(name: str) -> tuple[str, str] | None:
    """(module, function) of an open-r1 reward name, None for a name that is not open-r1's; one line for a
    reward its script builds from its own fields."""
    if name in OPEN_R1_REWARDS:
        return "open_r1.rewards", OPEN_R1_REWARDS[name]
    if name in OPEN_R1_BUILT:
        raise ConfigError(f"open-r1's reward '{name}' is built by its script from {OPEN_R1_BUILT[name]}; run open-r1's "
                          "grpo.py itself with `from rlhf_plugins.integrations.trl import GRPOTrainer`, or name a "
                          "function as module.function in reward_funcs")
    return None
