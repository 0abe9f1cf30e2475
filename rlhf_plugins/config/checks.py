"""Checks of the config alone, before any component is resolved: every key within its declared
bounds, the rules that tie several keys together, the folders it names, and the settings of
asynchronous training. Each fails with one line naming the key and how to fix it."""
from __future__ import annotations

from typing import Any

from ..algorithms import AGGREGATIONS
from ..errors import ConfigError
from ..settings import check_bounds
from .schema import Config

#: the estimators that whiten their token-level advantages over the batch themselves (std_norm)
TOKEN_WHITENED = ("gae", "reinforce", "reinforce_baseline")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_ranges(c: Config) -> None:
    """Every key within the bounds declared beside it (:func:`rlhf_plugins.settings.setting`), core
    and plugin sections alike, then the rules that tie several keys together."""
    check_bounds(c)
    for name, section in c.extra.items():
        check_bounds(section, f"{name}.")
    g, t, p, r = c.generation, c.train, c.algo.policy_loss, c.reward
    _require(
        p.aggregation in AGGREGATIONS,
        f"unknown loss aggregation '{p.aggregation}'; choose one of: {', '.join(AGGREGATIONS)} "
        "(--algo.policy_loss.aggregation)",
    )
    _require(
        r.overlong_buffer <= g.max_new_tokens,
        f"reward.overlong_buffer ({r.overlong_buffer}) must not exceed generation.max_new_tokens ({g.max_new_tokens})",
    )
    _require(r.clip_low is None or (r.clip is not None and r.clip_low < r.clip),
             f"reward.clip_low ({r.clip_low}) is the lower bound of a clip: give --reward.clip above it "
             f"({'none given' if r.clip is None else r.clip})")
    for url in r.remote_urls:
        _require(not url.endswith(".py"), f"reward.remote_urls entry '{url}' is a Python file, not a server; load it "
                                          f"with --plugin {url} and name its function in --reward.functions")
        _require(url.startswith(("http://", "https://")), f"reward.remote_urls entry '{url}' is not an http(s) URL")
    if r.filter_range is not None:
        _require(
            len(r.filter_range) == 2 and r.filter_range[0] < r.filter_range[1],
            f"reward.filter_range must be [low, high] with low < high; got {r.filter_range}",
        )
    _require(
        not r.dynamic_filtering or g.n_samples_per_prompt >= 2,
        "reward.dynamic_filtering compares samples of one prompt and needs generation.n_samples_per_prompt >= 2",
    )
    _check_policy_loss(p)
    _check_optimizer(c)
    _check_generation(c)
    _require(r.combine == "sum" or g.n_samples_per_prompt >= 2,
             "reward.combine normalize_then_sum normalises each reward within its prompt group and needs "
             "generation.n_samples_per_prompt >= 2")
    _check_advantage_and_kl(c)
    for key, betas in (("learner.betas", c.learner.betas), ("critic.betas", c.critic.betas)):
        _require(betas is None or (len(betas) == 2 and all(0 <= b < 1 for b in betas)),
                 f"config key '{key}' must be two numbers in [0, 1), e.g. [0.9, 0.999]; got {betas}")
    _require(c.model.dtype != "float16" or _has_gpu(),
             "model.dtype float16 needs a GPU (on a CPU it trains to NaN at the first step); use float32 or bfloat16")
    _check_train(t)
    if r.models:
        from ..models.reward_model import inspect_reward_model

        for path in r.models:
            inspect_reward_model(path, r.value_head_prefix)
    from ..models.folder import check_model_folder

    for key, folder in (("model.path", c.model.path), ("critic.path", c.critic.path),
                        ("model.reference_path", c.model.reference_path)):
        if folder:
            check_model_folder(folder, key, trust_remote_code=c.model.trust_remote_code, tokenizer=key == "model.path")
    _check_reference(c)
    check_data(c)
    check_best_metric(c)


def _check_reference(c: Config) -> None:
    """A reference model of its own (--model.reference_path) is used (KL on), scores every token of the
    policy's tokenizer, and has the policy's shape where the policy's weights are mixed into it."""
    path = c.model.reference_path
    if not path:
        return
    _require(c.algo.kl.coef > 0, f"model.reference_path '{path}' is the KL's reference model, and algo.kl.coef 0 runs "
                                 "without one; set --algo.kl.coef above 0 or drop --model.reference_path")
    from ..models.folder import REFERENCE_VOCAB, tokenizer_size
    from ..models.model_shape import ModelShape
    from ..models.tiny_model import default_model_path

    remote = c.model.trust_remote_code
    policy = c.model.path or default_model_path(quiet=True)
    reference = ModelShape.of_folder(path, remote)
    tokens = tokenizer_size(policy, remote)
    _require(tokens is None or reference.vocab >= tokens,
             f"model.reference_path '{path}' has a vocabulary of {reference.vocab} tokens and the policy"
             + REFERENCE_VOCAB.format(ours=tokens))
    _require(not c.algo.kl.ref_sync_steps or reference == ModelShape.of_folder(policy, remote),
             f"algo.kl.ref_sync_steps mixes the policy's weights into the reference model, and model.reference_path "
             f"'{path}' has another shape than the policy; drop one of them")


def _check_train(t: Any) -> None:
    """The run's name, and the samples it prints."""
    _require(not t.print_samples or t.log_samples_every,
             f"train.print_samples ({t.print_samples}) prints the samples of the steps train.log_samples_every picks; "
             "set --train.log_samples_every N (every N steps) as well")
    name = t.run_name
    _require(name is None or (name not in ("", ".", "..") and "/" not in name and "\\" not in name),
             f"train.run_name '{name}' must be a plain folder name inside train.output_dir (no '/' or '..')")


def check_data(c: Config) -> None:
    """The data files exist and are of a kind we read; the input template has its place and applies."""
    from ..data.prompts import check_input_template
    from ..data.sources import check_datasets

    d = c.data
    check_datasets(d.path, d.probs, "data")
    check_datasets(c.eval.path, [], "eval")
    check_input_template(d.input_template)
    _require(d.input_template is None or not (d.apply_chat_template and d.template_strings),
             "data.input_template puts plain-text prompts in place, but data.apply_chat_template renders every prompt "
             "with the tokenizer's chat template; add --data.apply_chat_template false (OpenRLHF's default) or drop "
             "--data.input_template")
    _require(d.system_prompt is None or d.apply_chat_template,
             "data.system_prompt is a chat message, which only the chat template renders; drop --data.system_prompt "
             "or leave --data.apply_chat_template true")


def eval_metric_names(c: Config) -> list[str]:
    """The metrics an evaluation of this config reports."""
    k = c.eval.n_samples
    return ["eval/pass@1", *([f"eval/pass@{k}"] if k > 1 else []), f"eval/mean@{k}", f"eval/maj@{k}", "eval/greedy"]


def check_best_metric(c: Config) -> None:
    """What needs a held-out evaluation has one: ``train.best_metric`` (one of its metrics) and
    ``eval.log_samples``."""
    from ..data.prompts import eval_source

    _require(not c.eval.log_samples or eval_source(c) is not None,
             "eval.log_samples writes the held-out evaluations' samples and this run evaluates on nothing: give "
             "--eval.path or --eval.split (and keep --eval.enabled true)")
    metric = c.train.best_metric
    if not metric:
        return
    names = eval_metric_names(c)
    _require(metric in names, f"train.best_metric '{metric}' is not an evaluation metric; choose one of: "
                              f"{', '.join(names)}")
    _require(eval_source(c) is not None, f"train.best_metric '{metric}' needs held-out evaluation: give --eval.path "
                                         "or --eval.split (and keep --eval.enabled true)")


def _has_gpu() -> bool:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def check_staleness(c: Config) -> None:
    """Asynchronous training trains on samples of older policies: it needs the engine's log-probs
    corrected for (or an explicit opt-out), and partial rollouts need something to overlap with."""
    k, mismatch = c.train.max_staleness, c.algo.policy_loss.mismatch
    if k >= 1 and mismatch == "none" and not c.train.allow_uncorrected_staleness:
        raise ConfigError(
            f"train.max_staleness {k} trains on samples of policies up to {k} update{'s' if k > 1 else ''} behind "
            "the learner, and "
            "algo.policy_loss.mismatch is none, so nothing corrects for it; use --algo.policy_loss.mismatch tis "
            "(or icepop, seq_mask_tis), or --train.allow_uncorrected_staleness true to train uncorrected"
        )
    if c.generation.partial_rollout and k == 0:
        raise ConfigError("generation.partial_rollout swaps weights during a generation, which needs "
                          "asynchronous training; set --train.max_staleness 1 (or more), or drop partial_rollout")


def _check_generation(c: Config) -> None:
    """Stop strings (sampling settings an engine refuses: its ``refuses_sampling``, in validate)."""
    g = c.generation
    _require(all(g.stop), "generation.stop holds an empty string, which would end every completion at once; "
                          "remove it")
    _require(not (g.stop and g.partial_rollout), "generation.stop is matched within one generation call, and a "
                                                 "partial rollout generates in chunks; drop one of them")


def _check_optimizer(c: Config) -> None:
    """Muon: torch.optim.Muon on the torch and FSDP2 learners, DeepSpeed's own on DeepSpeed -- the actor's,
    and the critic's where settings of its own (critic.optimizer, ...) make it another."""
    critic = c.learner_of("critic")
    for owner, learner in (("learner", c.learner), ("critic", critic if critic is not c.learner else None)):
        if learner is None or learner.optimizer != "muon":
            continue
        from ..learners.muon import check_torch_muon

        backend = learner.backend
        if backend in ("torch", "fsdp"):
            check_torch_muon()
        decay = "critic" if owner == "critic" and c.critic.weight_decay is not None else "learner"
        _require(backend != "deepspeed" or not learner.weight_decay or learner.weight_decay_all,
                 "DeepSpeed's Muon decays every parameter, biases and normalisation weights too: add "
                 f"--learner.weight_decay_all true to accept that, or use --{decay}.weight_decay 0 or another backend")
        own = owner == "critic" and (c.critic.muon_ns_steps is not None or c.critic.muon_nesterov is not None)
        muon = "critic" if own else "learner"
        _require(backend != "deepspeed" or (learner.muon_ns_steps == 5 and learner.muon_nesterov),
                 f"DeepSpeed's Muon runs 5 Newton-Schulz steps with Nesterov momentum; leave {muon}.muon_ns_steps and "
                 f"{muon}.muon_nesterov at their defaults with --learner.backend deepspeed")


def _check_advantage_and_kl(c: Config) -> None:
    a, k = c.algo.advantage, c.algo.kl
    _require(not a.normalize_advantages or a.estimator not in TOKEN_WHITENED,
             f"algo.advantage.normalize_advantages whitens sequence advantages; estimator '{a.estimator}' whitens "
             "its token advantages already (--algo.advantage.std_norm): drop --algo.advantage.normalize_advantages")
    _require(k.controller != "adaptive" or k.coef > 0, "an adaptive KL controller needs a starting algo.kl.coef > 0")


def _check_policy_loss(p: Any) -> None:
    """The rules among the policy loss's own keys."""
    _require(p.entropy_coef_min <= p.entropy_coef_max,
             f"algo.policy_loss.entropy_coef_min ({p.entropy_coef_min}) must not exceed entropy_coef_max "
             f"({p.entropy_coef_max})")
    _require(p.name != "vespo" or p.mismatch in ("none", "tis", "icepop"),
             f"algo.policy_loss.name vespo takes token mismatch weights into its sequence weight; "
             f"algo.policy_loss.mismatch {p.mismatch} is not a token weight: use tis or icepop")
    _require(p.mismatch_gate == "ratio" or p.mismatch in ("icepop", "seq_icepop"),
             f"algo.policy_loss.mismatch_gate {p.mismatch_gate} gates the tokens or sequences that icepop and "
             f"seq_icepop keep; mismatch {p.mismatch} keeps no such choice: use --algo.policy_loss.mismatch icepop "
             "(per token) or seq_icepop (per sequence)")
    _require(p.ratio_level == "token" or p.name in ("cispo", "sapo"),
             f"algo.policy_loss.ratio_level sequence applies to cispo and sapo; '{p.name}' has none (PPO on "
             "sequence ratios is --algo.policy_loss.name gspo or sequence_ppo): drop --algo.policy_loss.ratio_level")
    _require(p.dual_clip is None or p.name not in ("cispo", "sapo", "vespo"),
             f"algo.policy_loss.dual_clip bounds the clipped surrogate of ppo, gspo and sequence_ppo; '{p.name}' has "
             "no clip to bound: remove --algo.policy_loss.dual_clip")
