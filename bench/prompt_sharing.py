"""One update of the torch learner with each prompt encoded once for its group of samples (the shared
prompt's KV cache, rlhf_plugins/models/prompt_cache.py) against every sample run whole, with and
without activation checkpointing (the real-model default, under which the prompt used to be run per
sample), and in packed micro batches (``--learner.max_tokens_per_micro_batch``: a group's prompt once
in the row, its completions attending to it). The Qwen2.5-0.5B shape (hidden 896, grouped-query
attention, the 151,936-token vocabulary) with fewer layers, float32, GRPO's batch shape: prompts x
group samples, long prompts, short answers.
Each side runs in its own process: the seconds of an update after a first one, and the peak resident
memory that update added (Linux's ``VmHWM``, reset before it).

    python bench/prompt_sharing.py --json bench/results/prompt_sharing.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)

#: (name, gradient checkpointing, prompts shared by their samples, packed micro batches)
SIDES = (("checkpointed, shared", True, True, False), ("checkpointed, per sample", True, False, False),
         ("shared", False, True, False), ("per sample", False, False, False),
         ("packed, checkpointed, shared", True, True, True), ("packed, checkpointed, per sample", True, False, True))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--completion-tokens", type=int, default=32)
    p.add_argument("--json", type=Path)
    p.add_argument("--side", type=int, help=argparse.SUPPRESS)  # one side, in a child process
    return p.parse_args()


def batch(args: argparse.Namespace) -> dict:
    """``prompts`` random prompts of ``prompt_tokens``, each with ``group`` random completions of
    ``completion_tokens`` and random advantages."""
    import torch

    from rlhf_plugins.training.rollout import Rollout, make_batch

    g = torch.Generator().manual_seed(0)
    prompt_ids, completion_ids = [], []
    for _ in range(args.prompts):
        prompt = torch.randint(10, 50_000, (args.prompt_tokens,), generator=g).tolist()
        for _ in range(args.group):
            prompt_ids.append(prompt)
            completion_ids.append(torch.randint(10, 50_000, (args.completion_tokens,), generator=g).tolist())
    n = len(prompt_ids)
    rollout = Rollout(prompts=[""] * n, prompt_ids=prompt_ids, completion_ids=completion_ids, completions=[""] * n,
                      finish_reasons=["stop"] * n, rollout_logprobs=[[0.0] * len(c) for c in completion_ids],
                      columns={}, group_size=args.group, scores=[0.0] * n)
    out = make_batch(rollout, pad_id=0)
    out["advantages"] = torch.randn(out["action_mask"].shape, generator=g) * out["action_mask"]
    return out


def rss_gb(field: str = "VmRSS") -> float:
    """This process's resident memory (``VmHWM``: its peak since :func:`reset_peak`), GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start the peak resident memory (``VmHWM``) anew from now (Linux: ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def side(args: argparse.Namespace) -> dict:
    """Run one side in this process: the seconds and the added peak memory of an update after a first
    (which allocates the optimizer's states)."""
    from rlhf_plugins.algorithms import policy_losses
    from rlhf_plugins.algorithms.objective import Objective
    from rlhf_plugins.api import prepare
    from rlhf_plugins.learners.torch_learner import TorchLearner
    from rlhf_plugins.testing import backend_context, reduced_model_path

    name, checkpointing, shared, packed = SIDES[args.side]
    path = reduced_model_path("qwen2.5-0.5b", layers=args.layers, hidden=896)
    n = args.prompts * args.group
    budget = n * (args.prompt_tokens + args.completion_tokens) if packed else 0  # one micro batch either way
    config, pm, _ = prepare({"model": {"path": path}, "learner": {"gradient_checkpointing": checkpointing,
                                                                   "micro_batch_size": n, "lr": 1e-6,
                                                                   "max_tokens_per_micro_batch": budget},
                             "train": {"prompts_per_step": args.prompts},
                             "generation": {"n_samples_per_prompt": args.group}}, autoload=False)
    learner = TorchLearner(backend_context(config, "actor", path, pm))
    objective = Objective(policy_losses.ppo, config.algo.policy_loss)
    data = batch(args) if shared else dict(batch(args), group_size=1)
    learner.train(data, objective)
    reset_peak()
    before = rss_gb()
    start = time.perf_counter()
    learner.train(data, objective)
    seconds = time.perf_counter() - start
    peak = rss_gb("VmHWM")
    tokens = (args.prompts if shared else n) * args.prompt_tokens + n * args.completion_tokens
    return {"side": name, "seconds_per_update": round(seconds, 2), "update_peak_gb": round(peak - before, 2),
            "decoder_tokens": tokens}


def main() -> None:
    args = parse()
    if args.side is not None:
        print(json.dumps(side(args)))
        return
    rows = []
    for i in range(len(SIDES)):
        argv = [sys.executable, __file__, "--side", str(i)] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                              if k not in ("json", "side")]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    setup = {k: v for k, v in vars(args).items() if k not in ("json", "side")}
    if args.json:
        args.json.write_text(json.dumps({"setup": setup, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
