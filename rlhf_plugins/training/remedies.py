"""What to change for each kind of memory in the memory plan: named when a layout is refused before
launch and when a role runs out of memory (keys are the plan's item names)."""
from __future__ import annotations

#: what to change for each kind of memory, named in refusals and advice
REMEDIES = {
    "optimizer states": "shard them: --learner.backend deepspeed --deepspeed.zero_stage 3 over more ranks "
                        "(--ray.actor_workers), or train adapters only (--lora.rank 16)",
    "fp32 master weights": "shard them over more ranks (--ray.actor_workers)",
    "gradients": "shard them (--deepspeed.zero_stage 2 or 3 over more ranks) or --lora.rank 16",
    "offloaded gradients": "shard them over more ranks (--ray.actor_workers) or --lora.rank 16",
    "weights": "--model.dtype bfloat16, or ZeRO-3 (--deepspeed.zero_stage 3) over more ranks",
    "activations": "a smaller micro batch (--learner.micro_batch_size, --learner.max_tokens_per_micro_batch) or "
                   "--learner.gradient_checkpointing true",
    "logits chunk": "a smaller --learner.logits_memory_mb",
    "KV cache (reserved)": "--vllm.kv_cache_mb, a shorter --data.max_prompt_tokens or --generation.max_new_tokens",
    "KV cache": "fewer sequences per step (--train.prompts_per_step, --generation.n_samples_per_prompt), a shorter "
                "--generation.max_new_tokens or --vllm.kv_cache_mb",
    "decode logits": "fewer sequences per step (--train.prompts_per_step)",
    "sync staging": "a smaller --sync.bucket_mb, or a sync that stages nothing: --ray.colocate hybrid (in-process), "
                    "or LoRA adapters alone (--lora.rank 16 --sync.method adapter)",
    "gathered tensor": "more ranks do not help here: --model.dtype bfloat16",
    "packed output head": "vLLM's CPU build packs the head for its kernels: --vllm.dtype bfloat16 halves it",
    "gathered tensor's gradient": "more ranks do not help here: --model.dtype bfloat16, or --lora.rank 16 (a frozen "
                                  "tensor has no gradient)",
    "reduce bucket": "DeepSpeed's buckets are sized from the model; a smaller model or more nodes",
}
