"""Weight sync between a learner and a generation engine in separate Ray actors.

(1) Bucketed vs per-parameter broadcast (``--sync.bucket_mb 64`` vs ``0``, i.e. one
call and one broadcast per tensor, OpenRLHF's scheme) on a deep, narrow Llama with
many parameter tensors: calls per sync and seconds per sync.

(2) Colocated IPC (``--sync.method ipc``, ``--ray.colocate all``) bandwidth on a
larger model, against a plain in-process memcpy of the same bytes.

    python bench/weight_sync.py
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)


def build_model(out: Path, hidden: int, layers: int, heads: int) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlhf_plugins.models.tiny_model import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=256,
                      tie_word_embeddings=False)
    shutil.rmtree(out, ignore_errors=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def syncs(path: str, method: str, bucket_mb: float, colocate: str, repeats: int) -> dict[str, float]:
    from rlhf_plugins import PlacementContext
    from rlhf_plugins._lazy import resolve
    from rlhf_plugins.api import prepare
    from rlhf_plugins.training.roles import GenerationRole, PolicyRole

    config, pm, plan = prepare({"model": {"path": path}, "placement": {"strategy": "ray"},
                                "sync": {"method": method, "bucket_mb": bucket_mb},
                                "ray": {"colocate": colocate, "local_num_gpus": 4, "cpus_per_worker": 2}},
                               autoload=False)
    placement = resolve(plan.placement.factory)(PlacementContext(config, ("generation", "actor"), plugin_spec=pm.spec))
    try:
        engine = placement.create_role("generation", GenerationRole, config, pm.spec, path, plan.engine)
        actor = placement.create_role("actor", PolicyRole, config, pm.spec, path, plan.learner)
        sync = resolve(plan.sync.factory)(config)
        infos = []
        for i in range(repeats + 1):  # the first one sets up
            start = time.perf_counter()
            info = sync.sync(actor, engine, i)
            infos.append({**info, "seconds": time.perf_counter() - start})
        infos = infos[1:]
    finally:
        placement.shutdown()
    return {"seconds": statistics.median(i["seconds"] for i in infos), "rpcs": infos[0]["rpcs"],
            "tensors": infos[0]["tensors"], "bytes": infos[0]["bytes"]}


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    import ray

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    ray.init(address="local", num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)
    results: dict[str, dict] = {}
    deep = build_model(tmp / "rlhf-bench-deep", hidden=64, layers=48, heads=2)
    for name, mb in (("per-parameter", 0.0), ("bucketed 64 MB", 64.0)):
        results[name] = r = syncs(deep, "broadcast", mb, "none", args.repeats)
        print(f"{name:>16}: {r['rpcs']:4d} calls, {r['seconds'] * 1000:7.1f} ms per sync "
              f"({r['tensors']} tensors, {r['bytes'] / 2**20:.1f} MiB)", flush=True)
    a, b = results["per-parameter"], results["bucketed 64 MB"]
    print(f"  bucketed: {a['rpcs'] / b['rpcs']:.0f}x fewer calls, {a['seconds'] / b['seconds']:.1f}x faster "
          "(targets >= 10x and >= 3x)")
    wide = build_model(tmp / "rlhf-bench-wide", hidden=1024, layers=8, heads=16)
    results["ipc"] = r = syncs(wide, "ipc", 64.0, "all", args.repeats)
    copy = memcpy_seconds(r["bytes"], args.repeats)
    ipc_bw, copy_bw = r["bytes"] / r["seconds"] / 2**30, r["bytes"] / copy / 2**30
    results["memcpy"] = {"seconds": copy, "bytes": r["bytes"]}
    print(f"       ipc: {ipc_bw:.2f} GiB/s ({r['bytes'] / 2**20:.0f} MiB in {r['seconds'] * 1000:.0f} ms, "
          f"{r['rpcs']} calls); memcpy {copy_bw:.2f} GiB/s; ratio {ipc_bw / copy_bw:.2f} (target >= 0.5)")
    ray.shutdown()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
