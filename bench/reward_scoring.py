"""Reward scoring costs: a reward model scoring a rollout in batches vs one sample at a time, and
a remote reward server (OpenRLHF's protocol over HTTP on 127.0.0.1) vs the same reward in process
on the default run.

    python bench/reward_scoring.py --json bench/results/reward_scoring.json
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)


def reward_model(out: Path, hidden: int, layers: int) -> str:
    """A random reward model (Llama backbone, one-output head) with the tiny tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from rlhf_plugins.models.tiny_model import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, num_labels=1,
                      pad_token_id=tok.pad_token_id, max_position_embeddings=256)
    LlamaForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def scoring(path: str, samples: int, repeats: int) -> dict[str, float]:
    from rlhf_plugins.models.reward_model import RewardModelScorer
    from rlhf_plugins.models.tiny_model import task_rows

    rows = (task_rows() * (samples // 100 + 1))[:samples]
    prompts = [r["prompt"] for r in rows]
    completions = [r["label"] for r in rows]
    out = {}
    for name, batch in (("one at a time", 1), ("batched (64)", 64)):
        scorer = RewardModelScorer(path, batch_size=batch)
        scorer(prompts[:8], completions[:8])  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            scorer(prompts, completions)
            times.append(time.perf_counter() - start)
        out[name] = samples / statistics.median(times)
    out["ratio"] = out["batched (64)"] / out["one at a time"]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def per_step(args: list[str], cwd: str, steps: int) -> float:
    name = f"r{len(list(Path(cwd).glob('runs/*')))}"
    subprocess.run([sys.executable, "-m", "rlhf_plugins.cli", "train", *args, "--train.steps", str(steps),
                    "--train.progress", "false", "--train.save_every", "0", "--train.save_final", "false",
                    "--train.run_name", name], cwd=cwd, capture_output=True, text=True, check=True)
    return json.loads(Path(cwd, "runs", name, "summary.json").read_text())["seconds_per_step"]


def remote_overhead(steps: int) -> dict[str, float]:
    import httpx

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "rlhf_plugins.cli", "serve-reward", "--function", "exact_match",
                               "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/get_reward"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        with tempfile.TemporaryDirectory() as cwd:
            local = per_step(["--reward.functions", "exact_match"], cwd, steps)
            remote = per_step(["--reward.remote_urls", url], cwd, steps)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return {"in-process s/step": local, "remote s/step": remote, "overhead ms/step": (remote - local) * 1000}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=128, help="samples per rollout (16 prompts x 8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = reward_model(Path(tmp) / "rm", hidden=256, layers=4)
        s = scoring(path, args.samples, args.repeats)
    print(f"reward model, {args.samples} samples: one at a time {s['one at a time']:7.1f} samples/s, batched "
          f"{s['batched (64)']:7.1f} samples/s: {s['ratio']:.1f}x (target >= 5x)", flush=True)
    r = remote_overhead(args.steps)
    print(f"default run, exact_match in process {r['in-process s/step']:.3f} s/step, through a reward server on "
          f"127.0.0.1 {r['remote s/step']:.3f} s/step: {r['overhead ms/step']:+.1f} ms per step", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"scoring": s, "remote": r}, indent=2))


if __name__ == "__main__":
    main()
