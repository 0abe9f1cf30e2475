"""Multi-turn rollouts: environments and tools as plugins (``rlhf_environments``).

A run is multi-turn when ``--env.name`` names a registered environment or its rows name one in
``--env.column``. :func:`make_env_runner` builds the run's :class:`~.runner.EnvRunner`;
the loop turns one step's trajectories into a :class:`~rlhf_plugins.Rollout` whose completions
hold every token after the prompt, with ``action_masks`` marking the model's.

What reward functions see of a trajectory: ``completions`` is the text of its last model turn
(the answer), and the columns ``trajectory`` (the turns as chat messages) and ``env_reward``
(the environment's own reward, ``None`` where it has none; the ``env_reward`` reward function
returns it) come with the dataset's columns.
"""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..types import Environment


def used_environments(config: Any, pm: Any, columns: dict[str, list[Any]]) -> dict[str, Environment]:
    """The environments a run uses: ``--env.name`` and every name in the rows' ``--env.column``."""
    names = {v for v in columns.get(config.env.column, []) if v}
    if config.env.name:
        names.add(config.env.name)
    out = {}
    for name in sorted(names, key=str):
        if not isinstance(name, str):
            raise ConfigError(f"the data column '{config.env.column}' holds {type(name).__name__} {name!r}; it names "
                              "each row's environment as a string")
        try:
            out[name] = pm.components.get(Environment, name)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (--env.name or the data column '{config.env.column}')") from None
    return out


def make_env_runner(config: Any, pm: Any, columns: dict[str, list[Any]], tokenizer: Any) -> Any:
    """The run's environment runner, or ``None`` for single-turn runs."""
    envs = used_environments(config, pm, columns)
    if not envs:
        return None
    from .runner import EnvRunner

    return EnvRunner(config, tokenizer, envs)


def eval_sampler(runner: Any, engine: Any, prompts: Any) -> Any:
    """How held-out evaluation samples in a multi-turn run: trajectories, judged on their last
    model turn (the evaluator's ``sample``)."""
    from ..protocols import Samples

    def sample(idx: list[int], params: Any) -> tuple[Any, list[str], dict[str, list[Any]]]:
        rows = [{"prompt": prompts.prompts[i], **{k: v[i] for k, v in prompts.columns.items()}} for i in idx]
        traj = runner.run(engine.generate, [prompts.prompts[i] for i in idx], rows,
                          [f"held-out row {i + 1}" for i in idx], params)
        samples = Samples([j for j in range(len(idx)) for _ in range(params.n)], traj.completion_ids, traj.logprobs,
                          traj.finish_reasons)
        return samples, traj.final_texts, {"trajectory": traj.messages, "env_reward": traj.env_rewards,
                                           "prompt_ids": traj.prompt_ids}

    return sample
