"""The policy's log-probs over a real vocabulary, forward + backward: the fused head
(rlhf_plugins.models.fused_head), eager and with its chunks' elementwise work compiled
(--learner.compile), against autograd through a checkpoint per chunk (the path it replaced, still
taken by heads that are not plain linear layers). The Qwen2.5-0.5B head (151,936 x 896, tied
to the embedding), entropy computed and in the loss, the default logits budget (256 MB per chunk).

    python bench/head.py --json bench/results/head.json           # CPU: float32, 512 tokens
    python bench/head.py --bf16 --json bench/results/head_bf16.json   # CPU: bf16 autocast
    python bench/head.py --device cuda --tokens 16384             # GPU: float32 weights under bf16 autocast
                                                                  # (the torch learner's mixed precision)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)
import torch

from rlhf_plugins.models import logits as logits_mod
from rlhf_plugins.models.compiled import cpu_compiler
from rlhf_plugins.models.forward import LOGITS_MEMORY_MB
from rlhf_plugins.models.fused_head import COMPILED

VOCAB, HIDDEN = 151936, 896
#: the fused head, the same with its chunks' elementwise work compiled (--learner.compile), and the
#: autograd + checkpoint path it replaced
WAYS = ("fused", "fused, compiled", "autograd + checkpoint")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--logits-mb", type=float, default=LOGITS_MEMORY_MB)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on a CPU too (always on a GPU)")
    p.add_argument("--json", type=Path)
    return p.parse_args()


def one(way: str, head: torch.nn.Linear, hidden: torch.Tensor, tokens: torch.Tensor, chunk: int,
        autocast: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one forward + backward, and the head's weight gradient."""
    logits_mod.fusable = (lambda h: way != "autograd + checkpoint")
    setattr(head, COMPILED, way == "fused, compiled")
    head.weight.grad = None
    h = hidden.detach().requires_grad_()
    sync = torch.cuda.synchronize if hidden.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=autocast):
        lp, ent = logits_mod.head_token_stats(head, h, tokens, 1.0, True, chunk)
    (lp.sum() - 0.01 * ent.sum()).backward()
    sync()
    return time.perf_counter() - start, head.weight.grad.clone()


def main() -> None:
    args = parse()
    device = torch.device(args.device)
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, device=device)
    torch.nn.init.normal_(head.weight, std=0.02)
    hidden = torch.randn(args.tokens, HIDDEN, device=device)
    tokens = torch.randint(0, VOCAB, (args.tokens,), device=device)
    chunk = logits_mod.chunk_tokens(VOCAB, args.logits_mb)
    autocast = args.bf16 or device.type == "cuda"
    fusable = logits_mod.fusable
    rows = {}
    try:
        for way in WAYS if device.type == "cuda" or cpu_compiler() else WAYS[::2]:
            one(way, head, hidden, tokens, chunk, autocast)  # warm-up (and the compilation)
            times, grad = zip(*(one(way, head, hidden, tokens, chunk, autocast) for _ in range(args.repeats)))
            rows[way] = {"seconds": min(times), "grad": grad[-1]}
    finally:
        logits_mod.fusable = fusable
    a, b = rows["fused"]["grad"], rows["autograd + checkpoint"]["grad"]
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "tokens": args.tokens,
              "chunk_tokens": chunk, "dtype": "bf16 autocast over float32" if autocast else "float32",
              "ms": {k: round(v["seconds"] * 1e3, 1) for k, v in rows.items()},
              "speedup": rows["autograd + checkpoint"]["seconds"] / rows["fused"]["seconds"],
              "weight_grad_rel_diff": float((a - b).norm() / b.norm())}
    if "fused, compiled" in rows:
        c = rows["fused, compiled"]["grad"]
        result["compiled_speedup"] = rows["fused"]["seconds"] / rows["fused, compiled"]["seconds"]
        result["compiled_weight_grad_rel_diff"] = float((c - a).norm() / a.norm())
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
