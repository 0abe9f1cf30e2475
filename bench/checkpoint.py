"""Checkpoint write and resume: time and size, torch and DeepSpeed ZeRO-3 learners, the default
tiny model and a random ~100M-parameter Llama, against the floor of writing the same weights with
``save_pretrained`` plus the optimizer state with ``torch.save``, flushed to disk (fsync) as a
checkpoint is. A checkpoint also checksums every file (CRC-32, in parallel) for its manifest.

    python bench/checkpoint.py --json bench/results/checkpoint.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)


def build_100m(out: Path) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlhf_plugins.models.tiny_model import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=768, intermediate_size=2048, num_hidden_layers=14,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=256,
                      tie_word_embeddings=False)
    shutil.rmtree(out, ignore_errors=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def learner(path: str, backend: str):
    from rlhf_plugins._lazy import resolve
    from rlhf_plugins.api import prepare
    from rlhf_plugins.testing import backend_context

    raw = {"model": {"path": path}, "learner": {"backend": backend}, "deepspeed": {"zero_stage": 3}}
    config, pm, plan = prepare(raw, autoload=False)
    obj = resolve(plan.learner.factory)(backend_context(config, "actor", path, pm))
    return obj, config


def one_step(obj, config) -> None:
    """A real update, so that the optimizer holds its moments."""
    import torch

    from rlhf_plugins.algorithms.objective import Objective
    from rlhf_plugins.algorithms.policy_losses import ppo

    g = torch.Generator().manual_seed(0)
    seq = torch.randint(10, 300, (4, 24), generator=g)
    batch = {"sequences": seq, "attention_mask": torch.ones_like(seq), "action_mask": torch.ones(4, 8),
             "advantages": torch.randn(4, 8, generator=g)}
    obj.train(batch, Objective(ppo, config.algo.policy_loss))


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(path: str, backend: str, repeats: int) -> dict[str, float]:
    import torch

    from rlhf_plugins.training import checkpoint

    obj, config = learner(path, backend)
    one_step(obj, config)
    tmp = Path(tempfile.mkdtemp(prefix="rlhf-bench-ckpt-"))
    floors, writes, loads, size = [], [], [], 0
    for i in range(repeats):
        floor = tmp / f"floor-{i}"
        start = time.perf_counter()
        obj.save(str(floor))  # save_pretrained of the full weights
        torch.save(obj.optimizer.state_dict(), floor / "optimizer.pt")
        for file in floor.rglob("*"):  # on disk, as a checkpoint is
            if file.is_file():
                with open(file, "rb") as fh:
                    os.fsync(fh.fileno())
        floors.append(time.perf_counter() - start)
        run = tmp / f"run-{i}"
        start = time.perf_counter()
        ckpt = checkpoint.write(run, 1, lambda d: obj.save_checkpoint(str(d / "actor")) or {}, keep=1)
        writes.append(time.perf_counter() - start)
        size = du(ckpt)
        start = time.perf_counter()
        checkpoint.verify(ckpt)
        obj.load_checkpoint(str(ckpt / "actor"))
        loads.append(time.perf_counter() - start)
        shutil.rmtree(floor)
        shutil.rmtree(run)
    shutil.rmtree(tmp, ignore_errors=True)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in obj.model.parameters())  # ZeRO-3 partitions
    obj.shutdown()
    return {"params": params, "floor_s": statistics.median(floors), "write_s": statistics.median(writes),
            "resume_s": statistics.median(loads), "bytes": size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from rlhf_plugins.models.tiny_model import default_model_path

    models = {"tiny (default)": default_model_path(),
              "random Llama ~100M": build_100m(Path(tempfile.gettempdir()) / "rlhf-bench-100m")}
    results = {}
    for model, path in models.items():
        for backend in ("torch", "deepspeed"):
            key = f"{model}, {backend}"
            results[key] = r = measure(path, backend, args.repeats)
            print(f"{key:>32}: {r['params'] / 1e6:6.1f} M params, checkpoint {r['bytes'] / 2**20:7.1f} MiB, "
                  f"write {r['write_s']:6.2f} s (save_pretrained + optimizer {r['floor_s']:5.2f} s: "
                  f"{r['write_s'] / r['floor_s']:.2f}x, target <= 2x), resume {r['resume_s']:5.2f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
