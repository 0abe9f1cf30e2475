"""Decision hooks: one answer wins (``firstresult``).

The builtin implementation is ``trylast``, so any plugin may answer first or wrap
it with a new-style wrapper (``@hookimpl(wrapper=True)``), as the PEFT
integration does to add LoRA adapters to whatever model was loaded.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._markers import hookspec

if TYPE_CHECKING:
    from ..config.schema import Config


@hookspec(firstresult=True)
def rlhf_load_model(role: str, path: str, config: Config) -> Any:
    """Load the model of one role.

    Called once per role and process, inside the process that owns the role
    (this process under local placement, the role's worker under Ray);
    first-result. ``role`` is one of ``"actor"``, ``"reference"``, ``"critic"``,
    ``"generation"``; ``path`` is a local ``save_pretrained`` directory. Return a
    ``torch.nn.Module`` (a critic returns one whose forward gives per-token
    values), or ``None`` to let the next implementation decide.

    Example (wrap whatever is loaded)::

        @hookimpl(wrapper=True)
        def rlhf_load_model(role, path, config):
            model = yield
            if role == "actor":
                model.gradient_checkpointing_enable()
            return model
    """


@hookspec(firstresult=True)
def rlhf_extract_answer(completion: str, sample: Mapping[str, Any]) -> Any:
    """The answer a completion gives, for majority voting (``eval/maj@k``).

    Called in the driver for every evaluation sample; first-result. ``sample`` holds the
    prompt (``"prompt"``) and every other column of its dataset row (the label as ``"label"``).
    Return something comparable with ``str(label)`` -- answers equal as strings vote together --
    or ``None`` to let the next implementation decide. The builtin (``trylast``) takes the first
    number of the first line (``"12.0 apples"`` -> ``"12"``), else the first line.

    Example (``\\boxed{...}`` answers)::

        @hookimpl
        def rlhf_extract_answer(completion, sample):
            found = re.search(r"\\\\boxed\\{([^}]*)\\}", completion)
            return found.group(1).strip() if found else None
    """


@hookspec(firstresult=True)
def rlhf_admit_rollout(step: int, learner_version: int, engine_version: int, queued: list[int],
                       max_staleness: int) -> bool | None:
    """Whether the asynchronous loop may start generating the rollout of ``step`` now.

    Called in the driver's rollout worker (``train.max_staleness >= 1``) before each rollout, and
    again whenever the learner publishes new weights, until it answers ``True``; first-result.
    ``learner_version`` is the number of updates the learner has made, ``engine_version`` the
    number the engine's weights have, ``queued`` the steps whose rollouts are generated and not yet
    trained on. The bound is enforced by the core whatever the answer (a rollout starts only when
    ``learner_version >= step - max_staleness``), so a plugin can hold generation back -- to keep
    samples fresher, or the queue short -- but never make samples staler. Return ``None`` to let
    the next implementation decide; the builtin (``trylast``) admits as soon as the bound allows.

    Example (never more than one finished rollout waiting)::

        @hookimpl
        def rlhf_admit_rollout(step, learner_version, engine_version, queued, max_staleness):
            return len(queued) < 1
    """


@hookspec(firstresult=True)
def rlhf_rollout(prompts: list[Any], rows: list[dict[str, Any]], params: Any, engine: Any,
                 tokenizer: Any) -> dict[str, Any] | None:
    """Take over generation for one step (TRL's ``rollout_func``): return the samples, or ``None``
    to let the builtin generate (single-turn, or multi-turn with ``--env.name``).

    Called in the driver once per rollout (and refill round), first-result. ``prompts`` are the
    step's prompts as the dataset gives them, ``rows`` their dataset rows, ``params`` the
    :class:`~rlhf_plugins.SamplingParams` (``params.n`` samples per prompt), ``engine`` the
    generation role (``engine.generate(prompt_ids, params)``). Return a dict with
    ``prompt_ids`` (one per prompt or per sample), ``completion_ids`` and ``logprobs`` (one per
    sample, ``n`` consecutive per prompt), optionally ``env_mask`` (1 on tokens to train on, 0 on
    environment tokens) and ``finish_reasons``; any other key is a per-sample column for the reward
    functions.

    Example (sample with the run's engine, then append a fixed reply the policy is not trained on)::

        @hookimpl
        def rlhf_rollout(prompts, rows, params, engine, tokenizer):
            ids = [tokenizer(p)["input_ids"] for p in prompts]
            out = engine.generate(ids, params)
            reply = tokenizer("<|user|>ok", add_special_tokens=False)["input_ids"]
            return {"prompt_ids": ids,
                    "completion_ids": [c + reply for c in out.completion_ids],
                    "logprobs": [lp + [0.0] * len(reply) for lp in out.logprobs],
                    "env_mask": [[1] * len(c) + [0] * len(reply) for c in out.completion_ids]}
    """
