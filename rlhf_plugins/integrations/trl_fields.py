"""How each of TRL's GRPOConfig fields that we do not map is treated (:mod:`.trl_config`): an error
naming it when a config changes it (``UNSUPPORTED``: it changes training and we cannot honour it),
a note saying why it changes nothing here (``IGNORED_WHY``), or one note for all of the trainer's
bookkeeping (``BOOKKEEPING_PREFIXES``)."""
from __future__ import annotations

#: fields that change training and that we cannot honour (an error unless left at TRL's default)
UNSUPPORTED = {
    "sync_ref_model": "the reference model stays the initial policy",
    "top_entropy_quantile": "no entropy-quantile token masking",
    "multi_objective_aggregation": "rewards are combined as a weighted sum",
    "off_policy_mask_threshold": "no off-policy masking by threshold",
    "use_adaptive_entropy": "no adaptive entropy coefficient",
    "use_bias_correction_kl": "no bias-corrected KL",
}
#: fields that change nothing in training here, and why (one note lists those a config sets)
IGNORED_WHY = {
    "num_train_epochs": "rlhf-plugins counts rollout steps: set max_steps",
    "vllm_mode": "vLLM runs as our generation engine (local or a Ray actor)",
    "gradient_checkpointing_kwargs": "checkpointing always runs non-reentrant",
    "pad_to_multiple_of": "padding to a multiple does not change the loss",
    "use_cache": "the learner never caches; generation always does",
    "disable_dropout": "dropout stays as the model's config sets it (0.0 in Qwen2 and Llama configs)",
    "ds3_gather_for_generation": "weights reach the engine by weight sync",
    "trust_remote_code": "set --model.trust_remote_code",
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
