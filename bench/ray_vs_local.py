"""Time to first step and per-step time: Ray placement + DeepSpeed ZeRO-3 (2 actor
ranks over gloo, fake GPUs on a local Ray) versus local placement + torch learner,
on the default config (tiny Llama, addition task, GRPO).

    python bench/ray_vs_local.py --steps 20
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)

SETUPS = {
    "local + torch": {},
    "ray + deepspeed zero-3 (2 ranks)": {
        "placement": {"strategy": "ray"},
        "learner": {"backend": "deepspeed"}, "deepspeed": {"zero_stage": 3},
        "ray": {"actor_workers": 2, "local_num_gpus": 4},
    },
}


def run(raw: dict, steps: int) -> dict[str, float]:
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
    trainer.step(0)
    first = time.perf_counter() - start
    t = time.perf_counter()
    for step in range(1, steps + 1):
        trainer.step(step)
    per_step = (time.perf_counter() - t) / steps
    trainer.shutdown()
    return {"time_to_first_step_s": first, "seconds_per_step": per_step,
            "reward_last": trainer.history[-1]["reward/mean"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = {}
    for name, raw in SETUPS.items():
        results[name] = r = run(raw, args.steps)
        print(f"{name:>34}: first step after {r['time_to_first_step_s']:5.1f} s, "
              f"{r['seconds_per_step']:.3f} s/step", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "results": results}, indent=2))


if __name__ == "__main__":
    main()
