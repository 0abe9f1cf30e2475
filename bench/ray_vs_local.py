"""Time to first step and per-step time of the default config: local placement + torch learner,
the default Ray run (``--placement.strategy ray``: one actor per role on a local Ray, torch
learner), the hybrid layout (``--ray.colocate hybrid``: actor, reference and engine in one actor,
in-process weight sync) and Ray + DeepSpeed ZeRO-3 (2 actor ranks over gloo, fake GPUs). Prints where the
start-up goes (cluster, placement groups, each role -- the roles start concurrently) and a per-phase
table of a step (the loop's own ``time/*`` metrics, mean over the timed steps).

    python bench/ray_vs_local.py --steps 20
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)

SETUPS = {
    "local + torch": {},
    "ray + torch (default Ray run)": {"placement": {"strategy": "ray"}, "ray": {"local_num_gpus": 4}},
    "ray hybrid (actor+reference+engine in one actor)": {
        "placement": {"strategy": "ray"}, "ray": {"local_num_gpus": 4, "colocate": "hybrid"},
    },
    "ray + deepspeed zero-3 (2 ranks)": {
        "placement": {"strategy": "ray"},
        "learner": {"backend": "deepspeed"}, "deepspeed": {"zero_stage": 3},
        "ray": {"actor_workers": 2, "local_num_gpus": 4},
    },
}
PHASES = ("generate", "reference", "prepare", "train", "sync", "step")


def run(raw: dict, steps: int) -> dict:
    from transformers import AutoTokenizer

    from rlhf_plugins.api import prepare
    from rlhf_plugins.data.prompts import load_prompts
    from rlhf_plugins.models.tiny_model import default_model_path
    from rlhf_plugins.training.loop import Trainer

    raw = {**raw, "train": {"steps": steps + 1}}
    path = default_model_path()
    config, pm, plan = prepare(raw, autoload=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    start = time.perf_counter()
    trainer = Trainer(config, pm, plan, load_prompts(config.data, tokenizer), tokenizer, path)
    trainer.setup()
    set_up = time.perf_counter() - start
    trainer.step(0)
    first = time.perf_counter() - start
    t = time.perf_counter()
    for step in range(1, steps + 1):
        trainer.step(step)
    per_step = (time.perf_counter() - t) / steps
    startup = dict(getattr(trainer.placement, "startup", {}))
    trainer.shutdown()
    timed = trainer.history[1:]
    return {"time_to_first_step_s": first, "setup_s": set_up, "seconds_per_step": per_step, "startup_s": startup,
            "phase_s": {k: statistics.fmean(m.get(f"time/{k}", 0.0) for m in timed) for k in PHASES},
            "reward_last": trainer.history[-1]["reward/mean"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = {}
    for name, raw in SETUPS.items():
        results[name] = r = run(raw, args.steps)
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in r["startup_s"].items())
        print(f"{name:>48}: first step after {r['time_to_first_step_s']:5.1f} s, "
              f"{r['seconds_per_step']:.3f} s/step" + (f"  (start-up: {parts})" if parts else ""), flush=True)
    local = results["local + torch"]["phase_s"]
    print(f"\n{'per phase, s/step (mean):':>48}  " + "  ".join(f"{k:>9}" for k in PHASES))
    for name, r in results.items():
        print(f"{name:>48}  " + "  ".join(f"{r['phase_s'][k]:9.4f}" for k in PHASES))
    for name, r in results.items():
        if name != "local + torch":
            print(f"{name:>48}: {r['phase_s']['step'] / local['step']:.2f}x local per step")
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "results": results}, indent=2))


if __name__ == "__main__":
    main()
