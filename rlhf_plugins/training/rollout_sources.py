"""Where a step's samples come from: a plugin's own rollout (``rlhf_rollout``, how TRL's
``rollout_func`` runs), multi-turn trajectories with an environment, or the engine's single-turn
samples -- each made into a :class:`~.rollout.Rollout`."""
from __future__ import annotations

from typing import Any

from .rollout import Rollout


def sampled_rollout(prompts: Any, tokenizer: Any, idx: list[int], samples: Any, versions: list[list[int]],
                    group_size: int) -> Rollout:
    """The Rollout of an engine's single-turn ``samples`` for prompts ``idx`` of a PromptSet."""
    per_sample = [idx[j] for j in samples.prompt_index]
    return Rollout(
        prompts=[prompts.prompts[i] for i in per_sample],
        prompt_ids=[prompts.prompt_ids[i] for i in per_sample],
        completion_ids=samples.completion_ids,
        completions=tokenizer.batch_decode(samples.completion_ids, skip_special_tokens=True),
        finish_reasons=samples.finish_reasons,
        rollout_logprobs=samples.logprobs,
        columns={k: [v[i] for i in per_sample] for k, v in prompts.columns.items()},
        group_size=group_size,
        versions=versions,
    )


def step_rollout(trainer: Any, idx: list[int], params: Any) -> Rollout:
    """One step's samples for prompts ``idx`` (scored later by the loop): a plugin's own rollout
    (``rlhf_rollout``), else multi-turn trajectories, else the engine's single-turn samples."""
    p = trainer.prompts
    if reads_rows(trainer):  # rows only when someone reads them
        rows = [{"prompt": p.prompts[i], **{k: v[i] for k, v in p.columns.items()}} for i in idx]
        custom = trainer.pm.decide("rlhf_rollout", prompts=[p.prompts[i] for i in idx], rows=rows, params=params,
                                              engine=trainer.engine, tokenizer=trainer.tokenizer)
        if custom is not None:
            from .custom_rollout import custom_rollout

            return custom_rollout(trainer, idx, params, custom)
        if trainer.env_runner is not None:
            return env_rollout(trainer, idx, params, rows)
    samples, versions = trainer.sample([p.prompt_ids[i] for i in idx], params)
    return sampled_rollout(p, trainer.tokenizer, idx, samples, versions, params.n)


def reads_rows(trainer: Any) -> bool:
    """A rollout plugin or an environment may make the step's samples (else: the engine's plain
    single-turn samples)."""
    return bool(trainer.pm.hook.rlhf_rollout.get_hookimpls()) or trainer.env_runner is not None


def env_rollout(trainer: Any, idx: list[int], params: Any, rows: list[dict[str, Any]]) -> Any:
    """One step's trajectories for prompts ``idx`` (``rows``: their dataset rows) as a Rollout
    (scored later by the loop)."""
    p, n = trainer.prompts, params.n
    where = [f"dataset row {i + 1}" for i in idx]
    traj = trainer.env_runner.run(trainer.engine.generate, [p.prompts[i] for i in idx], rows, where, params)
    per_sample = [i for i in idx for _ in range(n)]
    columns = {k: [v[i] for i in per_sample] for k, v in p.columns.items()}
    columns["trajectory"], columns["env_reward"] = traj.messages, traj.env_rewards
    if trainer.env_runner.agents:  # OpenRLHF agents' scores, for dynamic filtering (every rollout of the run)
        columns["env_score"] = traj.env_scores
    rollout = Rollout(
        prompts=[p.prompts[i] for i in per_sample],
        prompt_ids=traj.prompt_ids,
        completion_ids=traj.completion_ids,
        completions=traj.final_texts,
        finish_reasons=traj.finish_reasons,
        rollout_logprobs=traj.logprobs,
        columns=columns,
        group_size=n,
        versions=[[trainer.engine_version] * len(c) for c in traj.completion_ids],
        action_masks=traj.action_masks,
        metrics=traj.metrics(),
    )
    return rollout
