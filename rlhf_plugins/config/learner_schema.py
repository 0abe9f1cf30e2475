"""The ``learner`` section of the config: the optimizer, its batches and schedule, precision and
compilation of the trainable model (:mod:`.schema` holds the whole config)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..settings import setting

#: torch.compile's modes (TRL's torch_compile_mode takes the same names)
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


@dataclass
class LearnerConfig:
    #: torch (one process) | deepspeed (ZeRO 0-3, several ranks) or a plugin's
    backend: str = "torch"
    #: peak learning rate of the policy
    lr: float = setting(5e-4, gt=0)
    #: decoupled weight decay (AdamW) or L2 (Adam, SGD)
    weight_decay: float = setting(0.0, ge=0)
    #: decay biases and normalisation weights too (by default they are left alone, as in transformers'
    #: Trainer, TRL and OpenRLHF)
    weight_decay_all: bool = False
    #: clip the global gradient norm to this (0: no clipping)
    max_grad_norm: float = setting(1.0, ge=0)
    #: passes over each rollout
    epochs: int = setting(1, ge=1)
    #: samples per optimizer step; 0 means the whole rollout (one step per rollout per epoch)
    mini_batch_size: int = setting(0, ge=0)
    #: samples per forward/backward (gradient accumulation); 0 means the mini batch
    micro_batch_size: int = setting(0, ge=0)
    #: pack micro batches of at most N real tokens, no padding (learner and reference); 0: micro_batch_size
    max_tokens_per_micro_batch: int = setting(0, ge=0)
    #: MiB of one chunk of output-head logits (log-probs and gradients a chunk of tokens at a time; 0: at once)
    logits_memory_mb: float = setting(256.0, ge=0)
    #: recompute activations in the backward pass (less memory, about a third more compute)
    gradient_checkpointing: bool = False
    #: 16-bit runs (torch learner): 16-bit weights + float32 masters; false: float32 weights under autocast
    master_weights: bool = True
    #: torch and fsdp learners: compile the decoder's norms, MLPs and the head's log-softmax (torch.compile)
    compile: bool = False
    #: what --learner.compile compiles: blocks (norms, MLPs) | layers (each whole decoder layer: fewer kernels)
    compile_scope: Literal["blocks", "layers"] = "blocks"
    #: torch.compile's mode for --learner.compile: reduce-overhead and max-autotune replay CUDA graphs (GPU)
    compile_mode: CompileMode = "default"
    #: round each batch's prompt and completion widths up to a multiple of N (not past data.max_prompt_tokens
    #: and generation.max_new_tokens), so that shapes repeat; 0: 64 with a CUDA-graph compile_mode, else 1 (none)
    pad_to_multiple_of: int = setting(0, ge=0)
    #: keep a moving average of the actor's weights and save the final model from it (OpenRLHF's --enable_ema)
    ema: bool = False
    #: the average's decay: average = beta x average + (1 - beta) x weights after every update
    ema_beta: float = setting(0.992, gt=0, lt=1)
    #: a mixture of experts' load-balancing loss, added to the policy's loss times this (Switch Transformer's,
    #: as transformers computes it; TRL's router_aux_loss_coef, OpenRLHF's --aux_loss_coef); empty: the
    #: model config's own router_aux_loss_coef (TRL's default); 0: none
    router_aux_loss_coef: float | None = setting(0.0, ge=0)
    #: dropout off in the actor's and the critic's training forwards (TRL's disable_dropout; the TRL converter
    #: carries its default, false): a model whose config keeps dropout (Seed-OSS, OPT, GPT-2) would otherwise
    #: train a perturbed policy whose log-probs are not the engine's. LoRA's own dropout (--lora.dropout) stays
    disable_dropout: bool = True
    #: adamw | adam | sgd | muon (Muon for the hidden matrices at muon_lr, AdamW for the rest at lr) |
    #: adafactor (transformers' Adafactor at lr, its second moments factored: TRL's optim adafactor)
    optimizer: Literal["adamw", "adam", "sgd", "muon", "adafactor"] = "adamw"
    #: Muon's learning rate (the hidden matrices; OpenRLHF's --muon.lr)
    muon_lr: float = setting(0.02, gt=0)
    #: Muon's momentum
    muon_momentum: float = setting(0.95, ge=0, lt=1)
    #: Muon's Nesterov momentum
    muon_nesterov: bool = True
    #: Newton-Schulz iterations per Muon step
    muon_ns_steps: int = setting(5, ge=1)
    #: Adam(W)'s beta1 and beta2
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    #: Adam(W)'s epsilon
    eps: float = setting(1e-8, gt=0)
    #: SGD's momentum
    momentum: float = setting(0.0, ge=0, lt=1)
    #: constant | linear | cosine to ``min_lr_ratio`` * lr over all updates, after ``warmup_steps`` of warm-up
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    #: optimizer updates of linear warm-up from 0 to lr
    warmup_steps: int = setting(0, ge=0)
    #: warm-up as a share of all optimizer updates (used when warmup_steps is 0)
    warmup_ratio: float = setting(0.0, ge=0, le=1)
    #: where linear and cosine decay end, as a share of lr
    min_lr_ratio: float = setting(0.0, ge=0, le=1)
