"""Ours vs TRL's GRPOTrainer on one GPU, at a real shape: a random-weight Qwen2.5-0.5B (its exact
configuration, vocabulary 151,936) whose end-of-sequence logit is held far down so every completion
runs to the budget on both sides (equal work), prompts of about 128 tokens, completions of 256
tokens, 8 prompts x 8 samples, bf16, transformers generation on both sides, the same learning rate,
KL coefficient, loss and gradient checkpointing (off on both). Each side runs in a process of its
own; reported: steps/s, generated tokens/s, peak GPU memory, and our training phase's achieved
FLOP/s (each prompt counted once per group, as our prefix-shared update runs it) as a fraction of a
bf16 matmul measured in the same invocation. Targets: >= 2x TRL's steps/s,
>= 0.4 of the matmul peak in training.

    python bench/gpu.py --json bench/results/gpu.json          # on the GPU (scripts/device_check.sh)
    python bench/gpu.py --device cpu --layers 2 --steps 1      # checking the script on a CPU
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)
from _trl import long_sums, step_clock, training_flops, warm_trainer

#: our side run again with one setting changed, after ours and TRL's (same invocation, same card)
VARIANTS = {
    "ours-compile": ("with the decoder's norms, MLPs and head's log-softmax compiled (--learner.compile)",
                     {"compile": True}),
    "ours-compile-4096": ("compiled, with a 4096 MB logits budget (run 5, docs/gpu.md: fewer chunks, fewer launches)",
                          {"compile": True, "logits_memory_mb": 4096}),
    "ours-compile-layers-4096": ("compiled as whole decoder layers (--learner.compile_scope layers: fewer launches), "
                                 "4096 MB logits", {"compile": True, "compile_scope": "layers", "logits_memory_mb": 4096}),
    "ours-compile-16384": ("compiled, with a 16384 MB logits budget (run 5's best eager budget: one chunk per micro batch)",
                           {"compile": True, "logits_memory_mb": 16384}),
    "ours-compile-layers-16384": ("compiled as whole decoder layers, 16384 MB logits",
                                  {"compile": True, "compile_scope": "layers", "logits_memory_mb": 16384}),
    "ours-graphs-layers-16384": ("compiled as whole decoder layers replayed as CUDA graphs (--learner.compile_mode "
                                 "reduce-overhead: one launch per graph where eager issues dozens), 16384 MB logits",
                                 {"compile": True, "compile_scope": "layers", "compile_mode": "reduce-overhead",
                                  "logits_memory_mb": 16384}),
    "ours-graphs-16384": ("compiled norms and MLPs replayed as CUDA graphs (--learner.compile_mode reduce-overhead), "
                          "16384 MB logits", {"compile": True, "compile_mode": "reduce-overhead", "logits_memory_mb": 16384}),
    "ours-autocast": ("with float32 weights under autocast (the precision of runs 1-3, docs/gpu.md)",
                      {"master_weights": False}),
}
SETUP = {"prompts": 8, "group": 8, "prompt_tokens": 128, "new_tokens": 256, "lr": 1e-6, "beta": 0.001, "rows": 64}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--layers", type=int, default=None, help="reduce the model's depth (checking on a CPU)")
    p.add_argument("--new-tokens", type=int, default=SETUP["new_tokens"])
    p.add_argument("--json", type=Path)
    p.add_argument("--sides", default="ours,trl", help="which sides to run, in this order (comma-separated): ours, trl, "
                   + ", ".join(f"{side} (ours {what})" for side, (what, _) in VARIANTS.items()))
    p.add_argument("--logits-mb", type=float, default=None, help="our learner.logits_memory_mb (default: ours)")
    p.add_argument("--only", choices=["ours", "trl", *VARIANTS], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = set(args.sides.split(",")) - {"ours", "trl", *VARIANTS}
    if unknown:
        p.error(f"--sides: no side {', '.join(sorted(unknown))} (see --help)")
    return args


def setup(out: Path, layers: int | None) -> tuple[str, str]:
    """The model (EOS held down: feature 0 of the residual stream is 1 for every token but EOS, no
    layer writes it, and EOS's tied embedding reads it with weight -50) and the prompts."""
    import torch

    from rlhf_plugins.models.shapes import build

    path = build("qwen2.5-0.5b", out / "model", layers=layers, dtype="bfloat16")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 1.0
        emb[tok.eos_token_id, 0] = -50.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
    model.save_pretrained(path)
    return str(path), long_sums(tok, SETUP["rows"], SETUP["prompt_tokens"], out)


def peak_gpu_gb() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    raw = {"model": {"path": args.model, "dtype": "bfloat16"}, "data": {"path": args.data},
           "reward": {"functions": ["exact_match"]}, "eval": {"enabled": False},
           "train": {"prompts_per_step": SETUP["prompts"], "steps": args.warmup + args.steps},
           "generation": {"n_samples_per_prompt": SETUP["group"], "max_new_tokens": args.new_tokens},
           "learner": {"lr": SETUP["lr"], "gradient_checkpointing": False,
                       **({"logits_memory_mb": args.logits_mb} if args.logits_mb else {}),
                       **VARIANTS.get(args.only, ("", {}))[1]},
           "algo": {"kl": {"coef": SETUP["beta"]}, "policy_loss": {"aggregation": "token-mean"}}}
    trainer = warm_trainer(raw, args.model, args.warmup, partial(step_line, args.only or "ours"))
    start, tokens = time.perf_counter(), 0.0
    for step in range(args.warmup, args.warmup + args.steps):
        m = trainer.step(step)
        step_line(args.only or "ours", step, m)
        tokens += m["completion/length"] * SETUP["prompts"] * SETUP["group"]
    elapsed = time.perf_counter() - start
    timed = trainer.history[args.warmup:]
    if os.environ.get("BENCH_PROFILE"):
        profile_step(trainer, args.warmup + args.steps)
    ids = trainer.prompts.prompt_ids
    trainer.shutdown()
    return {"steps_per_s": args.steps / elapsed, "tokens_per_s": tokens / elapsed, "peak_gpu_gb": peak_gpu_gb(),
            "completion_length": sum(m["completion/length"] for m in timed) / len(timed),
            "prompt_tokens": sum(len(ids[i]) for i in range(len(ids))) / len(ids),
            "train_seconds": sum(m["time/train"] for m in timed),
            "phase_seconds": {k: sum(m[f"time/{k}"] for m in timed) for k in ("generate", "prepare", "train", "sync")}}


def step_line(side: str, step: int, m: dict[str, Any]) -> None:
    """One line per step as it ends, so that a side the device check's deadline cuts off still shows
    how far it came and where its time went (the first steps compile and record CUDA graphs)."""
    print(f"  {side} step {step}: " + ", ".join(f"{k} {m[f'time/{k}']:.2f} s" for k in ("generate", "train")
                                                if f"time/{k}" in m), flush=True)


def profile_step(trainer: Any, step: int) -> None:
    """One more step with its update (the learner's train call) under torch's profiler
    (BENCH_PROFILE=1): the kernels that took the GPU's time, to see where training falls short of
    the matmul peak (not part of the timed steps)."""
    import torch

    learner = trainer.actor.learner
    train = learner.train
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if torch.cuda.is_available() else [])
    prof = torch.profiler.profile(activities=activities)

    wall = []

    def profiled(*args: Any, **kwargs: Any) -> Any:
        with prof:
            start = time.perf_counter()
            out = train(*args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall.append(time.perf_counter() - start)
        return out

    learner.train = profiled
    m = trainer.step(step)
    learner.train = train
    print("profiled step:", {k: round(v, 3) for k, v in m.items() if k.startswith("time/")}, flush=True)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    busy = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"update: {wall[0] * 1e3:.0f} ms wall, kernels busy {busy:.0f} ms over {sum(e.count for e in kernels)} "
          "launches", flush=True)
    print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60),
          flush=True)
    # the host's side: which operators the update calls most often (each launches one kernel or more)
    print(events.table(sort_by="count", row_limit=20, max_name_column_width=60), flush=True)


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_plugins.builtin_plugins.rewards import exact_match

    def reward(prompts, completions, label, **kwargs):
        return exact_match(prompts, [c[0]["content"] for c in completions], label)

    rows = [json.loads(x) for x in Path(args.data).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
                                 for r in rows])
    clock = step_clock()
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, use_cpu=args.device == "cpu", bf16=args.device == "cuda", seed=0,
                         per_device_train_batch_size=SETUP["prompts"] * SETUP["group"], gradient_accumulation_steps=1,
                         num_generations=SETUP["group"], max_completion_length=args.new_tokens,
                         learning_rate=SETUP["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                         beta=SETUP["beta"], temperature=1.0, num_iterations=1, loss_type="dapo",
                         gradient_checkpointing=False, max_steps=args.warmup + args.steps, logging_steps=1,
                         report_to=[], save_strategy="no", disable_tqdm=True, log_completions=False)
        trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=cfg, train_dataset=dataset,
                              processing_class=AutoTokenizer.from_pretrained(args.model), callbacks=[clock])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    timed, elapsed = clock.timed(args.warmup, args.steps)
    tokens = sum(clock.lengths[args.warmup:]) * SETUP["prompts"] * SETUP["group"]
    return {"steps_per_s": timed / elapsed, "tokens_per_s": tokens / elapsed, "peak_gpu_gb": peak_gpu_gb(),
            "completion_length": sum(clock.lengths[args.warmup:]) / max(1, len(clock.lengths[args.warmup:]))}


def matmul_peak(device: str) -> float:
    """bf16 matmul FLOP/s of this device (8192^3 on a GPU, 1024^3 on a CPU), best of 5."""
    import torch

    n = 8192 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / 5)
    return 2 * n**3 / best


def train_fraction(ours: dict[str, Any], model: str, steps: int, peak: float) -> dict[str, float]:
    """Achieved training FLOP/s over the matmul peak (``bench/_trl.py: training_flops``): ``shared``
    counts each prompt once per group, as our prefix-shared update runs it (the hardware's use);
    ``plain`` every sample's prompt, as runs 1-7 counted it (docs/gpu.md: it overstated the fraction)."""
    from rlhf_plugins.models.memory import ModelShape

    shape = ModelShape.of_folder(model)
    head = shape.vocab * shape.hidden
    flops = training_flops(shape.parameters - head, head, SETUP["prompts"], SETUP["group"],
                           ours.get("prompt_tokens", SETUP["prompt_tokens"]), ours["completion_length"])
    return {k: v * steps / max(ours["train_seconds"], 1e-9) / peak for k, v in flops.items()}


def write(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The JSON so far (rewritten after each side, so a run cut short keeps what it measured)."""
    if args.json:
        args.json.write_text(json.dumps({"setup": {**SETUP, **vars(args), "json": None}, "results": results}, indent=2,
                                        default=str))


def run_side(args: argparse.Namespace, side: str, model: str, data: str, tmp: Path) -> dict[str, Any]:
    """One side in a process of its own; a side that fails is recorded with its exit status."""
    out = tmp / f"{side}.json"
    done = subprocess.run([sys.executable, __file__, "--only", side, "--model", model, "--data", data, "--out", str(out),
                           "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
                           "--new-tokens", str(args.new_tokens)]
                          + (["--logits-mb", str(args.logits_mb)] if args.logits_mb else []))
    if done.returncode:
        print(f"{side:>5}: failed (exit {done.returncode})", flush=True)
        return {"error": f"exit {done.returncode}"}
    r = json.loads(out.read_text())
    print(f"{side:>5}: {r['steps_per_s']:.3f} steps/s  {r['tokens_per_s']:.0f} generated tokens/s  "
          f"completions {r['completion_length']:.0f} tokens  peak GPU {r['peak_gpu_gb']:.1f} GB", flush=True)
    return r


def main() -> None:
    args = parse()
    if args.only:
        result = run_trl(args) if args.only == "trl" else run_ours(args)
        args.out.write_text(json.dumps(result))
        return
    if args.device == "cpu":
        os.environ["RLHF_DEVICE"] = "cpu"
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, data = setup(Path(tmp), args.layers)
        peak = matmul_peak(args.device)
        results["matmul_tflops"] = peak / 1e12
        results["ours"] = results["trl"] = {"error": "not run"}
        for side in args.sides.split(","):  # in the order given: a deadline cuts the last ones
            r = results[side.replace("-", "_")] = run_side(args, side, model, data, Path(tmp))
            if side != "trl" and "error" not in r:
                fraction = train_fraction(r, model, args.steps, peak)
                r["train_fraction_of_matmul"], r["train_fraction_plain_equivalent"] = fraction["shared"], fraction["plain"]
                what = VARIANTS[side][0] if side in VARIANTS else "(defaults)"
                print(f"ours {what}: training at {fraction['shared']:.2f} of the bf16 matmul peak "
                      f"({results['matmul_tflops']:.3g} TFLOP/s; target >= 0.4; {fraction['plain']:.2f} counting "
                      "every sample's prompt)", flush=True)
            write(args, results)
    if "error" not in results["ours"] and "error" not in results["trl"]:
        results["ratio"] = {k: results["ours"][k] / results["trl"][k] for k in ("steps_per_s", "tokens_per_s")}
        print(f"ratio: {results['ratio']['steps_per_s']:.2f}x steps/s, {results['ratio']['tokens_per_s']:.2f}x "
              "tokens/s (target >= 2x)")
    write(args, results)
    sys.exit(1 if any("error" in results[side.replace("-", "_")] for side in args.sides.split(",")) else 0)


if __name__ == "__main__":
    main()
