"""Real model sizes on every execution path: peak memory per role process against its analytic
minimum, seconds per step by phase, weight-sync bandwidth against this machine's memcpy.

Builds random-weight models of the exact public configs (rlhf_plugins.models.shapes: Qwen2.5-0.5B,
Qwen3-0.6B, Llama-3.2-1B; real vocabularies, tied embeddings, grouped-query attention; the built-in
tokenizer beside them), runs ``rlhf train`` for a few steps on each path in a fresh process, and
reads each run's ``summary.json`` (per process: measured peak RSS, the memory plan's analytic need,
the imports) and ``metrics.jsonl``. A layout whose minimum cannot fit this machine is refused by the
plan before it starts; the table says so with the plan's line.

    python bench/scale.py                                   # every shape x every path (hours on 2 cores)
    python bench/scale.py --shapes qwen2.5-0.5b --paths local seeds
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)

ROOT = Path(__file__).resolve().parent.parent
RAY = ["--placement.strategy", "ray", "--ray.local_num_gpus", "4"]
ZERO3 = ["--learner.backend", "deepspeed", "--deepspeed.zero_stage", "3"]
#: path name -> flags (the seeds' production layout is "seeds")
PATHS = {
    "local": [],
    "local-vllm": ["--generation.backend", "vllm"],
    "seeds": [*RAY, *ZERO3, "--ray.actor_workers", "2", "--generation.backend", "vllm"],
    # the same layout in bfloat16 (weights, engine and reference; float32 master weights and Adam states)
    "seeds-bf16": [*RAY, *ZERO3, "--ray.actor_workers", "2", "--generation.backend", "vllm", "--model.dtype", "bfloat16"],
    "colocate-all-ipc": [*RAY, "--ray.colocate", "all", "--sync.method", "ipc"],
    "hybrid": [*RAY, "--ray.colocate", "hybrid"],
    "lora": ["--lora.rank", "16"],
    # the torch learner in bfloat16: 16-bit weights beside float32 masters (the engine shares the weights)
    "local-bf16": ["--model.dtype", "bfloat16"],
    "lora-bf16": ["--lora.rank", "16", "--model.dtype", "bfloat16"],
    # the same with the norms and MLPs compiled (torch.compile: fused kernels, fewer saved activations),
    # and both without gradient checkpointing (every layer's activations kept: what compiling saves shows)
    "local-bf16-compile": ["--model.dtype", "bfloat16", "--learner.compile", "true"],
    "local-bf16-no-ckpt": ["--model.dtype", "bfloat16", "--learner.gradient_checkpointing", "false"],
    "local-bf16-compile-no-ckpt": ["--model.dtype", "bfloat16", "--learner.compile", "true",
                                   "--learner.gradient_checkpointing", "false"],
    "zero3-offload": [*ZERO3, "--deepspeed.offload_optimizer", "true"],
    "zero3-resume": ZERO3,
    # the sharded learners side by side at two ranks (transformers engine, broadcast sync; no reference
    # model: with it the float32 0.5B layout fills this 24 GB machine and Ray's memory monitor kills a rank)
    "zero3-ray2": [*RAY, *ZERO3, "--ray.actor_workers", "2", "--algo.kl.coef", "0"],
    "fsdp-ray2": [*RAY, "--learner.backend", "fsdp", "--ray.actor_workers", "2", "--algo.kl.coef", "0"],
    # FSDP2 with the reference model sharded over two ranks of its own (KL against it, as the seeds run)
    "fsdp-ray2-ref": [*RAY, "--ray.local_num_gpus", "6", "--learner.backend", "fsdp", "--ray.actor_workers", "2",
                      "--ray.reference_workers", "2", "--algo.kl.coef", "0.01"],
}
WORKLOAD = ["--train.prompts_per_step", "4", "--generation.n_samples_per_prompt", "4",
            "--generation.max_new_tokens", "32", "--data.max_prompt_tokens", "64", "--eval.enabled", "false",
            "--train.progress", "false", "--train.save_final", "false"]


def memcpy_gbps(gib: float = 1.0) -> float:
    import torch

    src = torch.ones(int(gib * 2**28))
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * src.numel() * 4 / (time.perf_counter() - start) / 1e9


def model_for(shape: str, cache: Path) -> str:
    from rlhf_plugins.models.shapes import build

    folder = cache / shape
    if not (folder / "config.json").is_file():
        build(shape, folder)
    return str(folder)


def train(model: str, flags: list[str], cwd: Path, name: str, steps: int, extra: list[str] = ()) -> dict:
    cmd = [sys.executable, "-m", "rlhf_plugins.cli", "train", "--model.path", model, "--train.steps", str(steps),
           "--train.run_name", name, *WORKLOAD, *flags, *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, "RLHF_DISABLE_PLUGIN_AUTOLOAD": "1"})
    out = {"seconds": time.perf_counter() - start, "returncode": proc.returncode}
    run = cwd / "runs" / name
    if proc.returncode != 0:
        killed = f"killed by signal {-proc.returncode} (SIGKILL: the kernel's OOM killer), nothing printed"
        out["error"] = (proc.stderr.strip().splitlines() or [killed])[-1]
    plan = [line for line in proc.stdout.splitlines() if line.startswith(("memory plan:", "  "))]
    out["plan"] = [line for line in plan if "memory plan" in line or "GB" in line or " MB" in line][:12]
    if (run / "summary.json").is_file():
        out["summary"] = json.loads((run / "summary.json").read_text())
    if (run / "metrics.jsonl").is_file():
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        out["rows"] = [r for r in rows if "reward/mean" in r]
    return out


def phases(rows: list[dict]) -> dict[str, float]:
    """Mean seconds per phase over the steps after the first (the first pays one-time costs)."""
    later = rows[1:] or rows
    keys = ("time/generate", "time/prepare", "time/train", "time/sync", "time/step")
    return {k.removeprefix("time/"): sum(r.get(k, 0.0) for r in later) / len(later) for k in keys}


def resume_check(model: str, flags: list[str], cwd: Path, steps: int) -> dict:
    """The uninterrupted run against one stopped after ``steps - 1`` steps and resumed: equal metrics."""
    from rlhf_plugins.training.runlog import MEASURED

    whole = train(model, flags, cwd, "whole", steps, ["--train.save_every", "1"])
    if whole["returncode"] != 0:
        return whole
    train(model, flags, cwd, "cut", steps - 1, ["--train.save_every", "1"])
    cmd = [sys.executable, "-m", "rlhf_plugins.cli", "train", "--resume", str(cwd / "runs" / "cut"),
           "--train.steps", str(steps)]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    rows = [json.loads(line) for line in (cwd / "runs" / "cut" / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in rows if "reward/mean" in r]
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(MEASURED)}  # noqa: E731
    pairs = list(zip(map(strip, resumed), map(strip, whole.get("rows", []))))
    worst = max((abs(a[k] - b[k]) / max(1.0, abs(b[k])) for a, b in pairs for k in b
                 if isinstance(b.get(k), float) and isinstance(a.get(k), float)), default=0.0)
    # DeepSpeed's reduce-scatter sums in another order after a resume: equal to float32 rounding, not bits
    same = proc.returncode == 0 and len(pairs) == steps and all(a.keys() == b.keys() for a, b in pairs) and worst < 1e-5
    checkpoint = max((cwd / "runs" / "whole" / "checkpoints").iterdir())
    files = sorted(p.name for p in checkpoint.rglob("*") if p.is_file())
    return {**whole, "resume_identical": same, "resume_max_rel_diff": worst, "resume_error": proc.stderr.strip().splitlines()[-1:] if proc.returncode else [],
            "checkpoint_files": files[:20]}


def main() -> None:
    from rlhf_plugins.models.memory import ModelShape
    from rlhf_plugins.models.shapes import REDUCED_ONLY, SHAPES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=[s for s in SHAPES if s not in REDUCED_ONLY], choices=list(SHAPES))
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "rlhf-scale-models")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    args = p.parse_args()
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    results["memcpy_gbps"] = memcpy_gbps()
    for shape in args.shapes:
        model = model_for(shape, args.cache)
        for path in args.paths:
            with tempfile.TemporaryDirectory() as tmp:
                if path == "zero3-resume":
                    res = resume_check(model, PATHS[path], Path(tmp), args.steps)
                else:
                    res = train(model, PATHS[path], Path(tmp), path, args.steps)
            res["weights_gb"] = ModelShape.of_folder(model).parameters * 4 / 1e9  # float32, what a sync moves
            if res.get("rows"):
                res["phases"] = phases(res["rows"])
                res["steps_done"] = len(res.pop("rows"))
            results.setdefault(shape, {})[path] = res
            args.out.write_text(json.dumps(results, indent=1))
            print(shape, path, json.dumps({k: v for k, v in res.items() if k not in ("plan",)})[:600], flush=True)
    print(table(results))


def table(results: dict) -> str:
    """The README table: per shape and path, each process's peak / analytic (+ imports), phases, sync GB/s."""
    lines = ["| shape | path | process: peak RSS / analytic + imports (ratio) | s/step: generate, ref, train, sync | "
             f"sync GB/s (memcpy {results.get('memcpy_gbps', 0.0):.1f}) |", "|---|---|---|---|---|"]
    for shape, paths in results.items():
        if not isinstance(paths, dict):
            continue
        for path, res in paths.items():
            if "summary" not in res:
                why = res.get("error", "?")
                why = "killed by SIGKILL (the kernel's OOM killer), nothing printed" if why == "?" else why
                lines.append(f"| {shape} | {path} | did not run: {why.split(' -- ')[0].removeprefix('rlhf: error: ')} | | |")
                continue
            procs = "; ".join(  # a rule-based reward's process has no model: no analytic need to compare
                f"{name} {m['peak_rss_gb']:.2f} / {m['analytic_gb']:.2f} + {m['imports_gb']:.2f} ({m.get('ratio', 0):.2f})"
                for name, m in res["summary"]["memory"].items() if m["analytic_gb"] > 0)
            ph = res.get("phases", {})
            sync = ph.get("sync", 0.0)
            weights = res.get("weights_gb")
            gbps = f"{weights / sync:.2f}" if weights and sync > 1e-3 else "shared / -"
            lines.append(f"| {shape} | {path} | {procs} | {ph.get('generate', 0):.1f}, {ph.get('prepare', 0):.1f}, "
                         f"{ph.get('train', 0):.1f}, {sync:.2f} | {gbps} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
