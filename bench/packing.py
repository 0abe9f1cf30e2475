"""Learner tokens/s with packed micro batches vs padded ones, on completions of spread lengths.

A random Llama (hidden 256, 4 layers), 32 samples with 32-token prompts and completions of 8 to 256
tokens (uniform), one forward + backward of the PPO objective over every micro batch. Padded:
``--micro`` samples per micro batch, padded to the rollout's width (as today's micro batches are).
Packed: ``--learner.max_tokens_per_micro_batch`` = the padded micro batch's token count, so both hold
the same number of token slots. Real (non-pad) tokens per second, best of ``--repeats``.

    python bench/packing.py --json bench/results/packing.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--micro", type=int, default=4, help="samples per padded micro batch")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_plugins.algorithms import policy_losses
    from rlhf_plugins.algorithms.objective import Objective
    from rlhf_plugins.config.schema import PolicyLossConfig
    from rlhf_plugins.models.forward import policy_forward, split_batch
    from rlhf_plugins.models.packing import token_budget_split
    from rlhf_plugins.training.rollout import Rollout, make_batch

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512))
    n = args.samples
    prompts = [torch.randint(1, 512, (32,), generator=g).tolist() for _ in range(n)]
    completions = [torch.randint(1, 512, (int(torch.randint(8, 257, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(n)]
    rollout = Rollout([""] * n, prompts, completions, [""] * n, ["length"] * n, [[0.0] * len(c) for c in completions],
                      {}, 1, scores=[0.0] * n)
    batch = make_batch(rollout, 0)
    batch["advantages"] = torch.randn(batch["action_mask"].shape, generator=g)
    real = int(batch["attention_mask"].sum())
    width = batch["sequences"].shape[1]
    budget = args.micro * width
    objective = Objective(policy_losses.ppo, PolicyLossConfig(aggregation="token-mean"))

    def one_pass(parts: list[dict]) -> float:
        start = time.perf_counter()
        for part in parts:
            loss, _ = objective(policy_forward(model, part), part)
            (loss * objective.weight(part["action_mask"], batch["action_mask"])).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    results = {}
    for name, parts in (("padded", split_batch(batch, args.micro)), ("packed", token_budget_split(batch, budget))):
        one_pass(parts)  # warm-up
        seconds = min(one_pass(parts) for _ in range(args.repeats))
        results[name] = {"micro_batches": len(parts), "seconds": seconds, "tokens_per_s": real / seconds}
        print(f"{name:>7}: {len(parts):3d} micro batches  {real / seconds:8.0f} learner tokens/s  ({seconds:.2f} s)",
              flush=True)
    ratio = results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
    results["ratio"] = ratio
    print(f"  ratio: {ratio:.2f}x learner tokens/s (target >= 1.5x); {real} real tokens in {n} x {width} slots")
    if args.json:
        args.json.write_text(json.dumps({"setup": {**vars(args), "json": None, "width": width, "budget": budget,
                                                   "real_tokens": real}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
