"""Typed run configuration: dataclasses, loaded from YAML, overridden by dotted flags.

``rlhf train --config ppo.yaml --algo.advantage.estimator gae`` reads the YAML, applies each ``--section.field
value`` on top, and checks every key and type before any process, model or GPU is taken
(:mod:`rlhf_plugins.config.loading`). Plugins add typed, checked sections through the ``rlhf_add_options`` hook.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from ..settings import setting
from .algo_schema import CRITIC_OWN, AdvantageConfig, AlgoConfig, CriticConfig, KLConfig, PolicyLossConfig
from .learner_schema import LearnerConfig
from .task_schema import EnvConfig, EvalConfig

__all__ = ["AdvantageConfig", "AlgoConfig", "Config", "CriticConfig", "EnvConfig", "EvalConfig", "KLConfig",
           "LearnerConfig", "PolicyLossConfig"]

@dataclass
class ModelConfig:
    #: a local ``save_pretrained`` folder; empty means the embedded tiny Llama (built once, cached)
    path: str | None = None
    #: float32 | bfloat16 | float16 -- weights of every role
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: keep the output head's weight and logits in float32 in a 16-bit model -- the policy, the reference and
    #: the transformers engine; vLLM computes float32 logits from its 16-bit head (ScaleRL; TRL's
    #: cast_lm_head_to_fp32; a tied input embedding becomes float32 too)
    fp32_lm_head: bool = False
    #: the KL's reference model, a local save_pretrained folder with the policy's tokenizer (OpenRLHF's
    #: --ref_pretrain: e.g. the SFT model while the policy starts from a later checkpoint, or a teacher);
    #: empty: the initial policy
    reference_path: str | None = None
    #: run Python code that ships with a model folder (custom architectures); never asked interactively
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    #: JSONL / JSON / CSV / parquet / Arrow file, a folder of them or one datasets' save_to_disk wrote; several
    #: comma-separated (a.jsonl,b.parquet) are concatenated, or mixed by ``probs``; empty means the
    #: built-in addition task
    path: str | None = None
    #: with several datasets in ``path``: the probability of drawing each row from each (normalized;
    #: seeded; until every dataset has given all its rows; OpenRLHF's --prompt_data_probs)
    probs: list[float] = field(default_factory=list)
    #: column holding the prompt: a string, or a list of chat messages
    prompt_key: str = "prompt"
    #: column passed to reward functions as ``label`` (other columns are passed under their own names)
    label_key: str = "label"
    #: render prompts with the tokenizer's chat template (add_generation_prompt)
    apply_chat_template: bool = True
    #: with apply_chat_template: a plain-string prompt becomes a user message of the template (false: it is
    #: tokenized as it is, and only chat-message prompts are templated -- TRL's "standard" and
    #: "conversational" formats; the TRL drop-in and --trl-config set false)
    template_strings: bool = True
    #: a Jinja chat template, or a file holding one, used instead of the tokenizer's (and saved with the
    #: trained model; OpenRLHF's --tokenizer_chat_template)
    chat_template: str | None = None
    #: extra keyword arguments of every chat-template rendering -- prompts, tool turns, reward models'
    #: inputs -- e.g. {enable_thinking: false} for Qwen3 (TRL's chat_template_kwargs)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: a plain-text prompt the chat template does not render is put in this text at its one ``{}``
    #: (OpenRLHF's --input_template, e.g. "User: {}\nAssistant: "); needs apply_chat_template false
    #: (or template_strings false)
    input_template: str | None = None
    #: a system message put before every prompt the chat template renders (a chat prompt that opens with its
    #: own system message keeps that one); open-r1's system_prompt. Needs apply_chat_template
    system_prompt: str | None = None
    #: train on the first N rows of each dataset of data.path only (0: every row; OpenRLHF's --max_samples)
    max_samples: int = setting(0, ge=0)
    #: longer prompts are dropped (with a warning)
    max_prompt_tokens: int = setting(256, ge=1)
    #: sample prompts in a seeded random order each pass (false: file order)
    shuffle: bool = True


@dataclass
class GenerationConfig:
    #: generation engine: transformers | vllm (or a plugin's); see `rlhf plugins --components`
    backend: str = "transformers"
    #: completions sampled per prompt (the group of group_norm / rloo)
    n_samples_per_prompt: int = setting(8, ge=1)
    #: completion length budget in tokens
    max_new_tokens: int = setting(6, ge=1)
    #: sampling temperature of rollouts (log-probs are of the tempered distribution)
    temperature: float = setting(1.0, gt=0)
    #: nucleus sampling; 1 disables it
    top_p: float = setting(1.0, gt=0, le=1)
    #: 0 disables top-k
    top_k: int = setting(0, ge=0)
    #: min-p sampling: tokens below this fraction of the top token's probability are not drawn (0: off)
    min_p: float = setting(0.0, ge=0, le=1)
    #: > 1 makes tokens of the prompt and the completion so far less likely (HF's and vLLM's rule; 1: off)
    repetition_penalty: float = setting(1.0, gt=0)
    #: strings that end a completion (e.g. ["</answer>"]): it stops with the token that completes one, which
    #: it keeps, as vLLM's stop does (TRL's generation_kwargs stop); [] stops at EOS only
    stop: list[str] = field(default_factory=list)
    #: with train.max_staleness >= 1: generate in chunks, taking new weights between chunks (a long
    #: generation continues from its prefix with the newest policy; tokens record their version)
    partial_rollout: bool = False
    #: tokens per chunk of a partial rollout (weights can change after every chunk)
    partial_chunk_tokens: int = setting(32, ge=1)
    #: with train.max_staleness >= 1 and a reference model: generate a rollout in this many parts (whole
    #: prompt groups); the reference model scores each part while the engine generates the next
    rollout_parts: int = setting(2, ge=1)
    #: transformers engine on a GPU: capture a decode step as a CUDA graph and replay it for every
    #: token (one launch per token instead of hundreds); false decodes eagerly
    cuda_graphs: bool = True


@dataclass
class RewardConfig:
    #: reward functions by name; empty: a --plugin's only one, else the task's (none with models or servers)
    functions: list[str] = field(default_factory=list)
    #: reward model folders (TRL RewardTrainer or OpenRLHF format), scored in the reward role
    models: list[str] = field(default_factory=list)
    #: OpenRLHF-protocol reward servers (POST {"query", "prompts", "labels"} -> {"rewards"}), spread over
    remote_urls: list[str] = field(default_factory=list)
    #: one weight per source (functions, models, remote servers; default 1.0 each): a weighted sum
    weights: list[float] = field(default_factory=list)
    #: how the sources make one score: sum (the weighted sum) | normalize_then_sum (GDPO: each source's
    #: scores normalised within each prompt group first; TRL's multi_objective_aggregation)
    combine: Literal["sum", "normalize_then_sum"] = "sum"
    #: samples per reward-model forward
    model_batch_size: int = setting(16, ge=1)
    #: name of an OpenRLHF reward model's value head (empty: "score", else "value_head")
    value_head_prefix: str | None = None
    #: samples per request to a reward server
    remote_batch_size: int = setting(64, ge=1)
    #: requests to reward servers in flight at once
    remote_concurrency: int = setting(4, ge=1)
    #: attempts per request to a reward server before the step fails
    remote_retries: int = setting(3, ge=1)
    #: seconds any reward call may take (a function, a model, one request to a server); 0: no limit
    timeout: float = setting(300.0, ge=0)
    #: subtracted from the score of a completion that hit max_new_tokens without stopping (unset: 1 on
    #: the embedded model's own task, 0 otherwise)
    stop_penalty: float | None = None
    #: a completion that hit max_new_tokens without stopping: its score (after the penalties above and
    #: below) times this, 0 zeroing it; a negative value replaces the score (OpenRLHF's
    #: --stop_properly_penalty_coef, ProRL); unset: scores are not scaled
    truncated_scale: float | None = setting(None, le=1)
    #: DAPO soft overlong penalty: the last N tokens before max_new_tokens cost up to ``overlong_penalty``
    overlong_buffer: int = setting(0, ge=0)
    #: the largest overlong penalty (reached at max_new_tokens)
    overlong_penalty: float = setting(1.0, ge=0)
    #: normalise scores by running mean and std (state kept in checkpoints); a reward model's stored
    #: mean / std (OpenRLHF's normalize_reward config) is applied too
    normalize: bool = False
    #: apply a reward model's stored mean / std alone, without the running normalisation (OpenRLHF's
    #: --normalize_reward; the critic built from the reward model folds them into its head, as there)
    model_normalize: bool = False
    #: clip (shaped) scores to [-clip, clip]
    clip: float | None = setting(None, gt=0)
    #: with clip: the lower bound instead of -clip (OpenRLHF's --reward_clip_range LOW HIGH)
    clip_low: float | None = None
    #: drop prompt groups whose scores all agree (no learning signal) and refill from further prompts;
    #: the scores compared are the shaped rewards, or OpenRLHF's ``scores`` where a source returns them
    dynamic_filtering: bool = False
    #: with dynamic filtering, also drop groups whose mean score is not strictly inside [low, high]
    filter_range: list[float] | None = None
    #: generation rounds per step at most when refilling filtered groups
    filter_max_rounds: int = setting(4, ge=1)
    #: call a reward function again when it raises, up to this many times (0: an error stops the run)
    max_retries: int = setting(0, ge=0)


@dataclass
class PlacementConfig:
    #: where roles run: local (this process) | ray (placement groups) or a plugin's
    strategy: str = "local"


@dataclass
class SyncConfig:
    #: empty: the placement's default (inprocess for local, broadcast for ray)
    method: str | None = None
    #: bucket size of the broadcast / ipc methods (0: one tensor per bucket, one call each)
    bucket_mb: float = setting(64.0, ge=0)
    #: after every sync compare the engine's log-probs with the learner's on a fixed probe
    verify: bool = False


@dataclass
class TrainConfig:
    #: rollout steps (generate, score, update, sync) of the run
    steps: int = setting(200, ge=1)
    #: passes over the training prompts (OpenRLHF's --num_episodes, TRL's num_train_epochs): above 0 and
    #: without train.steps, the run makes ceil(episodes x prompts / prompts_per_step) steps
    episodes: float = setting(0.0, ge=0)
    #: prompts per rollout (each sampled n_samples_per_prompt times)
    prompts_per_step: int = setting(16, ge=1)
    #: seeds sampling, prompt order, initialisation and evaluation
    seed: int = setting(0, ge=0, le=2**32 - 1)
    #: where run directories are created
    output_dir: str = "runs"
    #: empty means ``<estimator>-<date>-<time>``
    run_name: str | None = None
    #: save the trained policy to ``<run>/final`` (save_pretrained)
    save_final: bool = True
    #: write a checkpoint every N steps (and at the end); 0: only at the end and on interruption
    save_every: int = setting(100, ge=0)
    #: complete checkpoints kept (the newest); 0 keeps all
    keep_checkpoints: int = setting(2, ge=0)
    #: also drop the oldest checkpoints while those kept take more than N GB on disk (the newest always
    #: stays); 0: no size limit (OpenRLHF's --max_ckpt_mem)
    keep_checkpoints_gb: float = setting(0.0, ge=0)
    #: an evaluation metric (e.g. eval/pass@1): the policy that scores best on it is kept in ``best/``
    best_metric: str | None = None
    #: max | min -- whether a larger or a smaller ``best_metric`` is better
    best_mode: Literal["max", "min"] = "max"
    #: show a progress bar (a terminal) or periodic progress lines (a log)
    progress: bool = True
    #: every N steps (the first step too), the step's samples -- prompt, completion, each reward's score,
    #: advantage, how it ended, the dataset's plain columns -- as rows of ``<run>/samples.jsonl``; 0: none
    #: (TRL's log_completions, verl's rollout_data_dir)
    log_samples_every: int = setting(0, ge=0)
    #: print the first N of those steps' samples as a table (TRL's num_completions_to_print)
    print_samples: int = setting(0, ge=0)
    #: threads for torch on this process (0 leaves torch's default)
    num_threads: int = setting(0, ge=0)
    #: reuse memory freed by large tensors (glibc: no mmap per tensor, no trim; RSS stays at its peak);
    #: empty: in the processes rlhf-plugins owns (the `rlhf` command, Ray role actors) on for small models
    #: and, for a real model (50M+ parameters), freed tensors handed back at once instead; nothing in a
    #: program that calls rlhf_plugins.api.train (its malloc is the program's)
    reuse_freed_memory: bool | None = None
    #: asynchronous RL: rollouts of the next K steps are generated while the learner trains, and no
    #: sample is more than K policy versions old when trained on; 0 is the synchronous loop
    max_staleness: int = setting(0, ge=0)
    #: allow max_staleness >= 1 without an off-policy correction (algo.policy_loss.mismatch none)
    allow_uncorrected_staleness: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    #: plugins to load, as with ``--plugin`` (entry-point names, modules, .py paths, no:NAME)
    plugins: list[str] = field(default_factory=list)
    #: sections added by plugins through ``rlhf_add_options``
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def section(self, name: str) -> Any:
        """A plugin's config section (added with ``options.add_section``)."""
        value = self.extra[name] if name in self.extra else getattr(self, name, None)
        if name in self.extra or dataclasses.is_dataclass(value):
            return value
        raise KeyError(f"no config section '{name}'")

    def learner_of(self, role: str) -> LearnerConfig:
        """The ``learner`` section as ``role``'s learner reads it: the critic's takes each of its own
        optimizer settings (``critic.betas``, ...) that is given, its warm-up ratio in place of warmup_steps."""
        own = {k: getattr(self.critic, k) for k in CRITIC_OWN if getattr(self.critic, k) is not None}
        if role != "critic" or not own:
            return self.learner
        return dataclasses.replace(self.learner, **own, **({"warmup_steps": 0} if "warmup_ratio" in own else {}))

    def updates_per_step(self) -> int:
        """Optimizer updates each step makes: the learner's epochs x the mini batches of a step's samples
        (TRL counts these as its steps)."""
        batch = self.train.prompts_per_step * self.generation.n_samples_per_prompt
        return max(1, self.learner.epochs * -(-batch // (self.learner.mini_batch_size or batch)))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update({k: _plain(v) for k, v in self.extra.items()})
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value
