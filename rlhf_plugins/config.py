"""Typed run configuration: dataclasses, loaded from YAML, overridden by dotted flags.

``rlhf train --config ppo.yaml --algo.advantage.estimator gae`` reads the YAML,
applies each ``--section.field value`` on top, and checks every key and type
before any process, model or GPU is taken (:mod:`rlhf_plugins.config_loading`). Plugins add their own sections through
the ``rlhf_add_options`` hook; those are typed and checked the same way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from .errors import PluginError


@dataclass
class ModelConfig:
    #: a local ``save_pretrained`` folder; empty means the embedded tiny Llama (built once, cached)
    path: str | None = None
    #: float32 | bfloat16 | float16 -- weights of every role
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclass
class DataConfig:
    #: JSONL / JSON / parquet file or a folder of them; empty means the built-in addition task
    path: str | None = None
    prompt_key: str = "prompt"
    #: column passed to reward functions as ``label`` (other columns are passed under their own names)
    label_key: str = "label"
    apply_chat_template: bool = True
    #: longer prompts are dropped (with a warning)
    max_prompt_tokens: int = 256
    shuffle: bool = True


@dataclass
class GenerationConfig:
    backend: str = "transformers"
    n_samples_per_prompt: int = 8
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    #: 0 disables top-k
    top_k: int = 0


@dataclass
class RewardConfig:
    #: reward functions by name; empty picks the only one a --plugin provides, else the task's default
    functions: list[str] = field(default_factory=list)
    #: one weight per function (default 1.0 each); the combined score is the weighted sum
    weights: list[float] = field(default_factory=list)
    #: subtracted from the score of a completion that hit max_new_tokens without stopping
    stop_penalty: float = 0.0
    #: DAPO soft overlong penalty: the last N tokens before max_new_tokens cost up to ``overlong_penalty``
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    #: normalise scores by running mean and std (state kept in checkpoints)
    normalize: bool = False
    #: clip (shaped) scores to [-clip, clip]
    clip: float | None = None
    #: drop prompt groups whose scores all agree (no learning signal) and refill from further prompts
    dynamic_filtering: bool = False
    #: with dynamic filtering, also drop groups whose mean score is not strictly inside [low, high]
    filter_range: list[float] | None = None
    #: generation rounds per step at most when refilling filtered groups
    filter_max_rounds: int = 4


@dataclass
class AdvantageConfig:
    estimator: str = "group_norm"
    gamma: float = 1.0
    lam: float = 0.95


@dataclass
class PolicyLossConfig:
    name: str = "ppo"
    #: ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_low: float = 0.2
    clip_high: float = 0.2
    #: dual-clip bound c > 1 for negative advantages; empty disables it
    dual_clip: float | None = None
    aggregation: str = "token-mean"
    entropy_coef: float = 0.0
    #: correct the generation engine / learner mismatch with the engine's log-probs:
    #: none | tis (truncated token weights) | icepop (mask tokens outside the band) | seq_mask_tis
    mismatch: Literal["none", "tis", "icepop", "seq_mask_tis"] = "none"
    #: TIS truncation and upper band of icepop / seq_mask_tis
    mismatch_high: float = 2.0
    #: lower band of icepop / seq_mask_tis
    mismatch_low: float = 0.5


@dataclass
class KLConfig:
    estimator: str = "k3"
    #: 0 disables the reference model entirely
    coef: float = 0.001
    #: apply KL as a token-level penalty in the reward instead of a loss term
    in_reward: bool = False
    #: fixed coefficient, or adaptive (Ziegler et al.): steer the measured KL towards ``target``
    controller: Literal["fixed", "adaptive"] = "fixed"
    target: float = 0.1
    horizon: int = 10000


@dataclass
class CriticConfig:
    #: empty: a critic runs exactly when the advantage estimator needs one
    enabled: bool | None = None
    #: a local folder with a critic (or any causal LM); empty: initialised from the policy
    path: str | None = None
    lr: float = 5e-3
    #: value-loss clipping around the rollout-time values; empty disables it
    value_clip: float | None = 0.2


@dataclass
class AlgoConfig:
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl: KLConfig = field(default_factory=KLConfig)


@dataclass
class LearnerConfig:
    backend: str = "torch"
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    #: passes over each rollout
    epochs: int = 1
    #: samples per optimizer step; 0 means the whole rollout (one step per rollout per epoch)
    mini_batch_size: int = 0
    #: samples per forward/backward (gradient accumulation); 0 means the mini batch
    micro_batch_size: int = 0
    #: DeepSpeed learner: ZeRO stage 0-3, CPU offload of optimizer states / parameters (stage 3)
    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    gradient_checkpointing: bool = False
    #: DeepSpeed learner: offload its states while the engine generates (GPU, ZeRO-3)
    sleep: bool = False


@dataclass
class PlacementConfig:
    strategy: str = "local"


@dataclass
class SyncConfig:
    #: empty: the placement's default (inprocess for local, broadcast for ray)
    method: str | None = None
    #: bucket size of the broadcast / ipc methods (0: one tensor per bucket, one call each)
    bucket_mb: float = 64.0
    #: after every sync compare the engine's log-probs with the learner's on a fixed probe
    verify: bool = False


@dataclass
class TrainConfig:
    steps: int = 200
    prompts_per_step: int = 16
    seed: int = 0
    output_dir: str = "runs"
    #: empty means ``<estimator>-<date>-<time>``
    run_name: str | None = None
    save_final: bool = True
    progress: bool = True
    #: threads for torch on this process (0 leaves torch's default)
    num_threads: int = 0


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
    #: plugins to load, as with ``--plugin`` (entry-point names, modules, .py paths, no:NAME)
    plugins: list[str] = field(default_factory=list)
    #: sections added by plugins through ``rlhf_add_options``
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def section(self, name: str) -> Any:
        """A plugin's config section (added with ``options.add_section``)."""
        if name in self.extra:
            return self.extra[name]
        value = getattr(self, name, None)
        if dataclasses.is_dataclass(value):
            return value
        raise KeyError(f"no config section '{name}'")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update({k: _plain(v) for k, v in self.extra.items()})
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class OptionRegistry:
    """The config schema: the core sections plus those plugins add in ``rlhf_add_options``."""

    def __init__(self) -> None:
        self.sections: dict[str, type] = {}
        self.providers: dict[str, str] = {}

    def add_section(self, name: str, cls: type, *, provider: str | None = None) -> None:
        if not dataclasses.is_dataclass(cls):
            raise PluginError(f"config section '{name}' must be a dataclass type, got {cls!r}")
        core = {f.name for f in dataclasses.fields(Config)}
        if name in core or name in self.sections:
            raise PluginError(f"config section '{name}' is already defined; pick another name")
        self.sections[name] = cls
        if provider:
            self.providers[name] = provider
