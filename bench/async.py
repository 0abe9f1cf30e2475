"""Asynchronous RL on Ray: steps/s and learning of max_staleness K = 0, 1, 2, and partial rollouts.

The generation engine and the learner run in separate Ray actors (one CPU thread each) on a local
Ray cluster with fake GPUs, on the default task (tiny Llama, addition, GRPO with TIS correction)
at 32 prompts x 16 samples per step, where making a rollout (generation, reward, reference
log-probs) and training on it take similar time.
Each K is run with several seeds; throughput is measured after the first step (start-up excluded),
learning as the reward gain (mean of the last 10 steps minus the first 10). A second part runs
K = 1 on long, variable-length completions (a random model of the same shape whose completions
end at random, up to 64 tokens) with and without partial rollouts, and reports engine and learner
idle time (``--partial-only`` runs that half alone).

    python bench/async.py --steps 60 --seeds 0 1 2 --json bench/results/async.json --png bench/results/async.png
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)

RAY = {"placement": {"strategy": "ray"}, "ray": {"local_num_gpus": 4, "local_num_cpus": 8}}
CORRECTED = {"policy_loss": {"mismatch": "tis"}}
#: the default task at a batch where generation and training take similar time
SHAPE = {"prompts_per_step": 32}
SAMPLES = 16
#: the partial-rollout half: a random model of the default's shape whose completions end at random
#: (median about 15 tokens, many run to the budget), so generation time varies a lot between samples
LONG = {"max_new_tokens": 64, "temperature": 1.0}
EOS_LIFT = 0.2


def long_talker(out: Path) -> str:
    """A random Llama with the default model's shape and tokenizer, built so that completions are
    long and of very different lengths: one residual feature is held constant (the embedding sets
    it, no layer writes it) and only the EOS logit reads it, so EOS comes at a steady small rate."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhf_plugins.models.tiny_model import default_model_path

    src = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(src)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        eos = tokenizer.eos_token_id
        model.lm_head.weight[eos] = 0.0
        model.lm_head.weight[eos, 0] = EOS_LIFT
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def run(k: int, seed: int, steps: int, generation: dict | None = None, train: dict | None = None,
        model: str | None = None) -> dict:
    from transformers import AutoTokenizer

    from rlhf_plugins.api import prepare
    from rlhf_plugins.data.prompts import load_prompts
    from rlhf_plugins.models.tiny_model import default_model_path
    from rlhf_plugins.training.loop import Trainer

    raw = {**RAY, "algo": CORRECTED, "train": {**SHAPE, **(train or {}), "steps": steps, "seed": seed,
                                                 "max_staleness": k},
           "generation": {"n_samples_per_prompt": SAMPLES, **(generation or {})}}
    path = model or default_model_path()
    if model:
        raw["model"] = {"path": model}
    config, pm, plan = prepare(raw, autoload=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    trainer = Trainer(config, pm, plan, load_prompts(config.data, tokenizer), tokenizer, path)
    trainer.setup()
    try:
        trainer.step(0)
        start = time.perf_counter()
        for step in range(1, steps):
            trainer.step(step)
        elapsed = time.perf_counter() - start
    finally:
        trainer.shutdown()
    h = trainer.history
    rewards = [m["reward/mean"] for m in h]
    mean = lambda key: statistics.fmean(m.get(key, 0.0) for m in h[1:])  # noqa: E731
    return {
        "steps_per_s": (steps - 1) / elapsed,
        "reward_gain": statistics.fmean(rewards[-10:]) - statistics.fmean(rewards[:10]),
        "rewards": rewards,
        "staleness_mean": mean("async/staleness_mean"),
        "learner_idle_s_per_step": mean("time/generate"),  # the learner's wait for its rollout
        "engine_idle_s_per_step": mean("async/engine_idle"),
        "generate_s_per_step": mean("time/generate") if k == 0 else None,
        "train_s_per_step": mean("time/train"),
        "completion_length": mean("completion/length"),
    }


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in results.items():
        curves = [r["rewards"] for r in runs]
        mean = [statistics.fmean(x) for x in zip(*curves)]
        ax.plot(mean, label=f"{name} ({runs[0]['steps_per_s']:.2f} steps/s, seed 0)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward/mean (mean over seeds)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--partial-steps", type=int, default=20)
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    p.add_argument("--partial-only", action="store_true",
                   help="run only the partial-rollout half and update its part of --json")
    args = p.parse_args()

    import ray

    ray.init(address="local", num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)
    if args.partial_only:
        partial = partial_rollouts(args)
        ray.shutdown()
        if args.json:
            old = json.loads(args.json.read_text())
            args.json.write_text(json.dumps({**old, "partial": partial}, indent=1))
        return
    results: dict[str, list[dict]] = {f"K={k}": [] for k in (0, 1, 2)}
    for seed in args.seeds:  # K interleaved per seed: a slow spell of the machine hits every K alike
        for k in (0, 1, 2):
            results[f"K={k}"].append(r := run(k, seed, args.steps))
            time.sleep(5)  # let Ray finish tearing down the previous run's actors before timing the next
            print(f"K={k} seed {seed}: {r['steps_per_s']:.2f} steps/s, reward gain {r['reward_gain']:+.3f}, "
                  f"staleness {r['staleness_mean']:.2f}", flush=True)
    base = results["K=0"]
    summary = {}
    for name, runs in results.items():
        speed = [r["steps_per_s"] / b["steps_per_s"] for r, b in zip(runs, base)]
        gains = [r["reward_gain"] for r in runs]
        summary[name] = {
            "steps_per_s_mean": statistics.fmean(r["steps_per_s"] for r in runs),
            "speedup_vs_sync": statistics.fmean(speed),
            "reward_gain_mean": statistics.fmean(gains),
            "reward_gain_spread": max(gains) - min(gains),
            "gain_minus_sync": statistics.fmean(gains) - statistics.fmean(b["reward_gain"] for b in base),
            "staleness_mean": statistics.fmean(r["staleness_mean"] for r in runs),
        }
        s = summary[name]
        print(f"{name}: {s['steps_per_s_mean']:.2f} steps/s ({s['speedup_vs_sync']:.2f}x sync), reward gain "
              f"{s['reward_gain_mean']:+.3f} (spread {s['reward_gain_spread']:.3f}, vs sync {s['gain_minus_sync']:+.3f})",
              flush=True)
    partial = partial_rollouts(args)
    ray.shutdown()
    if args.png:
        plot(results, args.png)
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "seeds": args.seeds, "summary": summary,
                                         "partial": partial, "runs": results}, indent=1))


def partial_rollouts(args: argparse.Namespace) -> dict[str, dict]:
    """K = 1 on long, variable-length completions (the random long talker), whole vs partial rollouts."""
    import tempfile

    partial = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = long_talker(Path(tmp) / "long-talker")
        for name, generation in (("K=1 long completions", LONG),
                                 ("K=1 long completions, partial rollouts",
                                  {**LONG, "partial_rollout": True, "partial_chunk_tokens": 8})):
            partial[name] = r = run(1, args.seeds[0], args.partial_steps, generation, model=model)
            time.sleep(5)
            r.pop("rewards")
            print(f"{name}: {r['steps_per_s']:.2f} steps/s, learner idle {r['learner_idle_s_per_step']:.3f} s/step, "
                  f"engine idle {r['engine_idle_s_per_step']:.3f} s/step, staleness {r['staleness_mean']:.2f}, "
                  f"length {r['completion_length']:.1f}", flush=True)
    return partial


if __name__ == "__main__":
    main()
