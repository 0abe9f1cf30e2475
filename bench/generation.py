"""Generation throughput: the vLLM backend vs the transformers backend, same prompts.

A small Llama (random weights, so completions run to the token budget) with the
embedded tokenizer; each backend generates ``--prompts`` x ``--n`` completions of
up to ``--max-new-tokens`` tokens; the best of ``--repeats`` timed rounds after one
warm-up round is reported. Both engines are the ones training uses.

    python bench/generation.py --hidden 512 --layers 4
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)


def build_model(out: Path, hidden: int, layers: int) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlhf_plugins.models.tiny_model import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    shutil.rmtree(out, ignore_errors=True)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def measure(backend: str, path: str, args: argparse.Namespace) -> dict[str, float]:
    import torch

    from rlhf_plugins import SamplingParams
    from rlhf_plugins.api import prepare
    from rlhf_plugins.models.tiny_model import task_rows
    from rlhf_plugins.testing import backend_context

    config, pm, plan = prepare({"generation": {"backend": backend}, "model": {"path": path}}, autoload=False)
    engine = plan.engine.factory(backend_context(config, "generation", path, pm))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    rows = task_rows()[: args.prompts]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True)["input_ids"]
               for r in rows]
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    engine.generate(prompts, params)
    best = None
    for _ in range(args.repeats):
        start = time.perf_counter()
        samples = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        tokens = sum(len(c) for c in samples.completion_ids)
        rate = tokens / elapsed
        if best is None or rate > best["tokens_per_s"]:
            best = {"tokens_per_s": rate, "tokens": tokens, "seconds": elapsed}
    engine.shutdown()
    del engine
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    path = build_model(Path(os.environ.get("TMPDIR", "/tmp")) / "rlhf-bench-gen-model", args.hidden, args.layers)
    results = {}
    for backend in ("transformers", "vllm"):
        results[backend] = r = measure(backend, path, args)
        print(f"{backend:>12}: {r['tokens_per_s']:8.0f} generated tokens/s ({r['tokens']} tokens in {r['seconds']:.2f} s)",
              flush=True)
    ratio = results["vllm"]["tokens_per_s"] / results["transformers"]["tokens_per_s"]
    print(f"       ratio: {ratio:.2f}x (target >= 3x)")
    results["ratio"] = ratio
    if args.json:
        args.json.write_text(json.dumps({"setup": {k: v for k, v in vars(args).items() if k != "json"},
                                         "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
