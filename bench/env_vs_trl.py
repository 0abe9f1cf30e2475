"""rlhf-plugins vs TRL GRPOTrainer(environment_factory=...) on the same multi-turn task, one invocation.

Same environment (the builtin ``Calculator``, a TRL-shaped class: its ``calculator`` method is the
tool), model (the embedded tool-calling tiny Llama), prompts (two-digit sums), group size,
trajectory budget (TRL's ``max_completion_length`` = our ``--env.max_total_tokens``), turn budget
(TRL's ``max_tool_calling_iterations`` = our ``--env.max_turns`` - 1), reward (the last turn's
answer against the label), learning rate, KL coefficient and number of steps. Both run on the CPU
in this process with transformers generation; the first ``--warmup`` steps of each are not timed.
Prints steps/s, completion tokens/s (model and tool tokens) and model turns/s of both, and the ratios.

    python bench/env_vs_trl.py --steps 10
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import _env  # noqa: F401  (sets the benchmark environment before heavy imports)
from _trl import common_flags, step_clock, warm_trainer


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_flags(p, steps=10, warmup=2, prompts=8, group=8, lr=5e-4)
    p.add_argument("--max-completion", type=int, default=64, help="tokens of a whole trajectory")
    p.add_argument("--max-turns", type=int, default=2, help="model turns per trajectory")
    return p.parse_args()


def answer_reward(prompts, completions, label, **kwargs):
    """1 when the last model turn is the label (TRL gives the trajectory as messages, we give text)."""
    last = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if str(a).strip() == str(lab) else 0.0 for a, lab in zip(last, label)]


def run_ours(args: argparse.Namespace, model_path: str) -> dict[str, float]:
    raw = {
        "train": {"prompts_per_step": args.prompts, "steps": args.warmup + args.steps, "seed": 0},
        "learner": {"lr": args.lr},
        "model": {"path": model_path},
        "data": {"path": "builtin:calculator-train"},
        "algo": {"kl": {"coef": args.beta}, "advantage": {"estimator": "group_norm"},
                 "policy_loss": {"aggregation": "token-mean"}},
        "generation": {"n_samples_per_prompt": args.group},
        "env": {"name": "calculator", "max_total_tokens": args.max_completion, "max_turns": args.max_turns},
        "eval": {"enabled": False},
    }
    trainer = warm_trainer(raw, model_path, args.warmup)
    tokens = turns = 0.0
    n = args.prompts * args.group
    start = time.perf_counter()
    for step in range(args.warmup, args.warmup + args.steps):
        m = trainer.step(step)
        tokens += (m["completion/length"] + m["env/env_tokens"]) * n
        turns += m["env/turns"] * n
    elapsed = time.perf_counter() - start
    trainer.shutdown()
    rewards = [m["reward/mean"] for m in trainer.history]
    return {"steps_per_s": args.steps / elapsed, "tokens_per_s": tokens / elapsed, "turns_per_s": turns / elapsed,
            "seconds": elapsed, "reward_first": rewards[0], "reward_last": rewards[-1]}


def run_trl(args: argparse.Namespace, model_path: str) -> dict[str, float]:
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_plugins.builtin_plugins.environments import Calculator
    from rlhf_plugins.models.tool_model import calculator_rows

    rows = calculator_rows("train")
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
                                 for r in rows])

    clock = step_clock()
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, seed=0,
            per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
            num_generations=args.group, max_completion_length=args.max_completion,
            max_tool_calling_iterations=args.max_turns - 1,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            beta=args.beta, temperature=1.0, num_iterations=1, loss_type="dapo", scale_rewards="group",
            max_steps=args.warmup + args.steps, logging_steps=1, report_to=[], save_strategy="no",
            disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model_path, reward_funcs=answer_reward, args=cfg, train_dataset=dataset,
                              processing_class=AutoTokenizer.from_pretrained(model_path), callbacks=[clock],
                              environment_factory=Calculator)
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    timed, elapsed = clock.timed(args.warmup, args.steps)
    n = args.prompts * args.group
    tokens = sum(clock.lengths[args.warmup:]) * n
    # a tool-call round is followed by one more model turn (at most max_tool_calling_iterations rounds)
    turns = sum(1.0 + min(c, args.max_turns - 1) for c in clock.calls[args.warmup:]) * n
    return {"steps_per_s": timed / elapsed, "tokens_per_s": tokens / elapsed, "turns_per_s": turns / elapsed,
            "seconds": elapsed, "reward_first": clock.rewards[0], "reward_last": clock.rewards[-1]}


def main() -> None:
    args = parse()
    import os

    import torch
    import transformers

    from rlhf_plugins.models.tool_model import tool_model_path

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model_path = tool_model_path()
    results: dict[str, dict[str, float]] = {}
    for name, fn in (("rlhf-plugins", run_ours), ("trl", run_trl)):
        if args.only and name != {"ours": "rlhf-plugins", "trl": "trl"}[args.only]:
            continue
        torch.manual_seed(0)
        results[name] = r = fn(args, model_path)
        print(f"{name:>13}: {r['steps_per_s']:6.2f} steps/s  {r['tokens_per_s']:8.0f} completion tokens/s  "
              f"{r['turns_per_s']:7.1f} turns/s  ({args.steps} steps in {r['seconds']:.1f} s; reward "
              f"{r['reward_first']:.2f} -> {r['reward_last']:.2f})", flush=True)
    if "rlhf-plugins" in results and "trl" in results:
        ours, trl = results["rlhf-plugins"], results["trl"]
        results["ratio"] = {k: ours[k] / trl[k] for k in ("steps_per_s", "tokens_per_s", "turns_per_s")}
        q = results["ratio"]
        print(f"        ratio: {q['steps_per_s']:6.2f}x steps/s  {q['tokens_per_s']:6.2f}x tokens/s  "
              f"{q['turns_per_s']:6.2f}x turns/s (target >= 1.5x steps/s)")
    if args.json:
        setup = {k: v for k, v in vars(args).items() if k not in ("json", "only")}
        args.json.write_text(json.dumps({"setup": setup, "results": results, "torch_threads": torch.get_num_threads(),
                                         "python": sys.version.split()[0]}, indent=2))


if __name__ == "__main__":
    main()
