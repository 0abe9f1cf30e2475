"""How each of TRL's GRPOConfig fields is treated (:mod:`.trl_config` applies these tables): mapped
to one of our keys (``DIRECT``) or by hand (``DERIVED``, with the value tables below), a note saying
why it changes nothing here (``IGNORED_WHY``), or one note for all of the trainer's bookkeeping
(``BOOKKEEPING_PREFIXES``); any other field a config changes is an error naming it."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: fields that change nothing in training here, and why (one note lists those a config sets)
IGNORED_WHY = {
    "vllm_mode": "vLLM runs as our generation engine (local or a Ray actor)",
    "gradient_checkpointing_kwargs": "checkpointing always runs non-reentrant, every decoder layer, its saved "
                                     "tensors on the device (--learner.gradient_checkpointing)",
    "use_cache": "the learner never caches; generation always does",
    "ds3_gather_for_generation": "weights reach the engine by weight sync",
    "use_liger_kernel": "the output head, log-softmax and gather already run as one fused, chunked function; "
                        "--learner.compile fuses the norms and MLPs Liger's other kernels cover",
    "liger_kernel_config": "Liger's kernels are not used (see use_liger_kernel)",
    "auto_find_batch_size": "the memory plan checks the batch against the machine before launch (set "
                            "--learner.micro_batch_size or --learner.max_tokens_per_micro_batch)",
    "enable_jit_checkpoint": "a SIGTERM or SIGINT always finishes the step and writes a checkpoint",
    "cache_implementation": "the transformers engine reserves its own KV cache (fixed-shape decode steps)",
    "use_transformers_continuous_batching": "the transformers engine decodes the whole rollout in fixed-shape "
                                            "steps (CUDA graphs on GPUs); vLLM with use_vllm",
    "transformers_continuous_batching_config": "see use_transformers_continuous_batching",
    "use_transformers_paged": "see use_transformers_continuous_batching",
    "optim_target_modules": "TRL's Trainer reads it only for the GaLore and APOLLO optimizers, which have no "
                            "equivalent here (their optim stops the conversion)",
    "label_smoothing_factor": "it smooths the Trainer's language-modelling loss, which TRL's GRPO loss replaces",
    "average_tokens_across_devices": "it sets how the Trainer counts num_items_in_batch, which TRL's GRPO loss does "
                                     "not read (its loss_type sets the normalization; ours is "
                                     "--algo.policy_loss.aggregation)",
}
#: trainer bookkeeping this project does its own way (run directory, metrics, checkpoints, devices)
BOOKKEEPING_PREFIXES = ("logging_", "log_", "save_", "eval_", "hub_", "push_to_hub", "report_to", "dataloader_",
                        "ddp_", "fsdp", "trackio", "include_", "skip_memory", "num_completions_to_print",
                        "per_device_eval", "torch_empty_cache", "tf32", "full_determinism", "data_seed",
                        "prediction_loss_only", "remove_unused_columns", "label_names", "length_column_name",
                        "load_best_model", "metric_for_best", "greater_is_better", "ignore_data_skip",
                        "resume_from_checkpoint", "restore_callback", "overwrite_output_dir", "do_", "debug",
                        "local_rank", "project", "batch_eval_metrics", "bf16_full_eval", "fp16_full_eval",
                        "accelerator_config", "deepspeed", "parallelism_config", "num_generations_eval",
                        "vllm_server", "vllm_group_port", "disable_tqdm")

def expected(conv: Any) -> str:
    """What a converter takes, for an error line (its type's name; a lambda's: a number)."""
    name = getattr(conv, "__name__", "")
    return {"<lambda>": "a number", "strings": "a string or a list of strings",
            "pad_multiple": "'auto', None or a number >= 1"}.get(name, name or "a value")


def strings(value: Any) -> list[str]:
    """A string or a list of strings (vLLM's ``stop``, transformers' ``stop_strings``) as a list."""
    items = [value] if isinstance(value, str) else list(value or [])
    if not all(isinstance(x, str) for x in items):
        raise TypeError("expected strings")
    return items


def pad_multiple(value: Any) -> int:
    """TRL's ``pad_to_multiple_of`` as ``learner.pad_to_multiple_of``: "auto" (TRL pads only on Neuron)
    is 0, ours (padding where CUDA graphs are replayed); None is 1, no padding; else the number."""
    if value == "auto":
        return 0
    if value is None or str(value).lower() in ("none", "null"):
        return 1
    if int(value) < 1:
        raise ValueError("expected a multiple >= 1")
    return int(value)


def mapping(value: Any) -> dict[str, Any]:
    """A dict field of TRL's: a mapping, or (from a command line) its JSON text, as transformers reads
    its dict fields; empty for None."""
    if isinstance(value, str):
        import json

        value = json.loads(value)
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"expected a mapping, got {type(value).__name__}")
    return dict(value or {})


#: transformers 5.25's names of fields it renamed -> the names TRL's configs set (kept there as aliases that
#: mirror the new ones); a new name set, not None, is read as the old
RENAMED = {"activation_checkpointing": "gradient_checkpointing",
           "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs"}


def fold_renamed(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with each of :data:`RENAMED`'s new names in place of its old one (where set), so that a
    config of either transformers release converts alike."""
    out = {k: v for k, v in fields.items() if k not in RENAMED}
    for new, old in RENAMED.items():
        if fields.get(new) is not None:
            out[old] = fields[new]
    return out


def current_defaults(defaults: dict[str, Any]) -> dict[str, Any]:
    """TRL's defaults with the meaning its newest releases give them: earlier 1.x releases (1.7 among them)
    defaulted router_aux_loss_coef to 0.001, applied to a mixture of experts only, where later ones default
    to None, the model config's own coefficient -- ours when it is left unset (a number set for a dense
    model is refused here: it weights nothing)."""
    out = dict(defaults)
    if out.get("router_aux_loss_coef") is not None:
        out["router_aux_loss_coef"] = None
    return out


#: GRPOConfig field -> (our dotted key, converter)
DIRECT: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "learning_rate": ("learner.lr", float),
    "cast_lm_head_to_fp32": ("model.fp32_lm_head", bool),
    "router_aux_loss_coef": ("learner.router_aux_loss_coef", lambda v: None if v is None else float(v)),
    "disable_dropout": ("learner.disable_dropout", bool),
    "vllm_structured_outputs_regex": ("vllm.structured_outputs_regex", lambda v: None if v is None else str(v)),
    "num_generations": ("generation.n_samples_per_prompt", int),
    "max_completion_length": ("generation.max_new_tokens", int),
    "temperature": ("generation.temperature", float),
    "top_p": ("generation.top_p", float),
    "top_k": ("generation.top_k", lambda v: int(v or 0)),
    "min_p": ("generation.min_p", lambda v: float(v or 0)),
    "top_entropy_quantile": ("algo.policy_loss.top_entropy_quantile", float),
    "repetition_penalty": ("generation.repetition_penalty", float),
    "beta": ("algo.kl.coef", float),
    "epsilon": ("algo.policy_loss.clip_low", float),
    "num_iterations": ("learner.epochs", int),
    "max_grad_norm": ("learner.max_grad_norm", float),
    "weight_decay": ("learner.weight_decay", float),
    "adam_epsilon": ("learner.eps", float),
    "seed": ("train.seed", int),
    "entropy_coef": ("algo.policy_loss.entropy_coef", float),
    "gradient_checkpointing": ("learner.gradient_checkpointing", bool),
    "reward_weights": ("reward.weights", lambda v: [float(x) for x in v] if v else []),
    "vllm_gpu_memory_utilization": ("vllm.gpu_memory_utilization", float),
    "vllm_tensor_parallel_size": ("vllm.tensor_parallel_size", int),
    "vllm_max_model_length": ("vllm.max_model_len", lambda v: None if v is None else int(v)),
    "vllm_enable_sleep_mode": ("vllm.sleep", bool),
    "vllm_model_impl": ("vllm.model_impl", str),
    "shuffle_dataset": ("data.shuffle", bool),
    "mask_truncated_completions": ("algo.policy_loss.mask_truncated", bool),
    "off_policy_mask_threshold": ("algo.policy_loss.off_policy_mask", lambda v: None if v is None else float(v)),
    "sapo_temperature_pos": ("algo.policy_loss.sapo_temperature_pos", float),
    "sapo_temperature_neg": ("algo.policy_loss.sapo_temperature_neg", float),
    "vespo_k_pos": ("algo.policy_loss.vespo_k_pos", float),
    "vespo_lambda_pos": ("algo.policy_loss.vespo_lambda_pos", float),
    "vespo_k_neg": ("algo.policy_loss.vespo_k_neg", float),
    "vespo_lambda_neg": ("algo.policy_loss.vespo_lambda_neg", float),
    "chat_template_kwargs": ("data.chat_template_kwargs", mapping),
    "pad_to_multiple_of": ("learner.pad_to_multiple_of", pad_multiple),
}
#: fields handled by hand below
DERIVED = {
    "epsilon_high", "loss_type", "scale_rewards", "importance_sampling_level", "per_device_train_batch_size",
    "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size", "max_steps", "use_vllm",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap",
    "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
    "bf16", "fp16", "output_dir", "run_name", "use_cpu", "adam_beta1", "adam_beta2", "optim", "lr_scheduler_type",
    "lr_scheduler_kwargs", "warmup_steps", "max_tool_calling_iterations", "torch_compile", "torch_compile_backend",
    "torch_compile_mode", "model_init_kwargs", "train_sampling_strategy", "delta", "sync_ref_model",
    "ref_model_sync_steps", "ref_model_mixup_alpha", "use_bias_correction_kl", "multi_objective_aggregation",
    "use_adaptive_entropy", "entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max",
    "generation_kwargs", "num_train_epochs", "optim_args", "normalize_advantages", "reward_clip_range",
    "trust_remote_code",
}
#: generation_kwargs keys (transformers' GenerationConfig or vLLM's SamplingParams; they override TRL's own
#: sampling fields, as in TRL) -> (our dotted key, converter); vLLM's top_k -1 and transformers' None: no top-k
GENERATION_KWARGS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "temperature": ("generation.temperature", float),
    "top_p": ("generation.top_p", float),
    "top_k": ("generation.top_k", lambda v: max(int(v or 0), 0)),
    "min_p": ("generation.min_p", lambda v: float(v or 0)),
    "repetition_penalty": ("generation.repetition_penalty", float),
    "max_tokens": ("generation.max_new_tokens", int),
    "max_new_tokens": ("generation.max_new_tokens", int),
    "stop": ("generation.stop", strings),
    "stop_strings": ("generation.stop", strings),
}
DTYPES = ("float32", "bfloat16", "float16")
#: from_pretrained arguments of model_init_kwargs that change nothing here, and why
INIT_IGNORED = {"attn_implementation": "this package's attention (SDPA with its own masks and KV caches) runs",
                "device_map": "each role places its model on its own device", "use_cache": IGNORED_WHY["use_cache"],
                "low_cpu_mem_usage": "models of 50M+ parameters load empty and fill from their files"}
OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw": "adamw",
              "adam": "adam", "sgd": "sgd", "adafactor": "adafactor"}
#: transformers' AdamW variants whose update is AdamW's, their states kept another way (-> how)
ADAMW_STORED_OTHERWISE = {
    "adamw_8bit": "keeps in 8 bits (bitsandbytes)", "adamw_bnb_8bit": "keeps in 8 bits (bitsandbytes)",
    "paged_adamw_8bit": "keeps in 8 bits, paged (bitsandbytes)", "paged_adamw_32bit": "pages (bitsandbytes)",
    "adamw_torch_8bit": "keeps in 8 bits (torchao)", "adamw_torch_4bit": "keeps in 4 bits (torchao)",
    "adamw_apex_fused": "fuses (apex)", "adamw_torch_npu_fused": "fuses (Ascend NPUs)",
    "adamw_torch_xla": "keeps on XLA devices",
}
SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant",
              "cosine_with_min_lr": "cosine"}
#: TRL loss_type -> the aggregation its normaliser is (TRL's "dapo" and "cispo" divide by the tokens of
#: the accumulation window, "grpo" and "sapo" average per-sequence means, "luspo" per-sequence sums)
LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
              "dr_grpo": "seq-mean-token-sum-norm", "cispo": "token-mean", "sapo": "seq-mean-token-mean",
              "luspo": "seq-mean-token-sum", "vespo": "token-mean"}
#: TRL loss_types whose per-token loss is not the clipped surrogate: our policy loss of that name
LOSS_NAMES = {"cispo": "cispo", "sapo": "sapo", "vespo": "vespo"}
SAMPLING_CORRECTION = {"token_truncate": "tis", "token_mask": "icepop", "sequence_mask": "seq_mask",
                       "sequence_truncate": "seq_tis"}
#: fields of earlier TRL / transformers releases, gone from TRL 1.x's GRPOConfig, that older YAML files still
#: hold -> (our dotted key, converter, the note the conversion prints)
LEGACY: dict[str, tuple[str, Callable[[Any], Any], str]] = {
    "max_prompt_length": ("data.max_prompt_tokens", int, "TRL 0.x's max_prompt_length (gone from TRL 1.x) becomes "
                          "--data.max_prompt_tokens: longer prompts are dropped with a warning, where TRL 0.x cut "
                          "them from the left"),
    "warmup_ratio": ("learner.warmup_ratio", float, "transformers 4's warmup_ratio (transformers 5 reads a "
                     "warmup_steps below 1 as the ratio) becomes --learner.warmup_ratio"),
}
