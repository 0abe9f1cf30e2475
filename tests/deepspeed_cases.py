"""The DeepSpeed learner beside the torch learner, in a process of its own: ``python -m tests.deepspeed_cases
OUT.json`` runs each case of tests/test_deepspeed_learner.py and writes what each measured (DeepSpeed's
process group and ZeRO-3's partitioned construction are process-wide, and other tests of a pytest worker
create and destroy process groups of their own)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from tests.helpers import random_batch

LR = 1e-3
#: two tokens of the reduced Gemma 2's logits a chunk (soft-capped: 16 bytes a logit)
TWO_TOKENS_MB = 2 * 512 * 16 / 2**20


def gemma2_path(out: Path) -> str:
    """A two-layer Gemma 2 with a cap (0.5) that bends its logits and would bend its hidden states."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhf_plugins.models.folder import save_pretrained, save_tokenizer
    from rlhf_plugins.models.tiny_model import default_model_path

    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma2", vocab_size=512, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  query_pre_attn_scalar=32, final_logit_softcapping=0.5)
    save_pretrained(AutoModelForCausalLM.from_config(config, dtype=torch.float32), out)
    save_tokenizer(AutoTokenizer.from_pretrained(default_model_path(quiet=True)), out)
    return str(out)


def _base(path: str, learner: dict) -> dict[str, Any]:
    return {"model": {"path": path}, "train": {"prompts_per_step": 3}, "generation": {"n_samples_per_prompt": 4},
            "learner": {"lr": LR, **learner}}


def _deepspeed(path: str, learner: dict, stage: int, **sections: Any) -> Any:
    from rlhf_plugins.api import prepare
    from rlhf_plugins.learners.deepspeed_learner import DeepSpeedLearner
    from rlhf_plugins.testing import backend_context

    base = _base(path, learner)
    config, pm, _ = prepare({**base, "learner": {**base["learner"], "backend": "deepspeed"},
                             "deepspeed": {"zero_stage": stage}, **sections}, autoload=False)
    return DeepSpeedLearner(backend_context(config, "actor", path, pm))


def _learners(path: str, learner: dict, stage: int) -> tuple[Any, Any, Any]:
    from rlhf_plugins.api import prepare
    from rlhf_plugins.learners.torch_learner import TorchLearner
    from rlhf_plugins.testing import backend_context

    torch_cfg, pm, _ = prepare(_base(path, learner), autoload=False)
    local = TorchLearner(backend_context(torch_cfg, "actor", path, pm))
    return local, _deepspeed(path, learner, stage), torch_cfg


def one_update_each(path: str, learner: dict, stage: int) -> dict[str, Any]:
    """One PPO update of each learner on the same batch (old log-probs the model's own): what each logged
    and the largest weight difference after it."""
    from rlhf_plugins.algorithms import policy_losses
    from rlhf_plugins.algorithms.objective import Objective

    local, ds, config = _learners(path, learner, stage)
    try:
        batch = random_batch(group=4, prompts=3, seed=5)
        g = torch.Generator().manual_seed(1)
        batch["advantages"] = torch.randn(batch["action_mask"].shape, generator=g) * batch["action_mask"]
        batch["old_logprobs"] = local.logprobs(batch)
        objective = Objective(policy_losses.ppo, config.algo.policy_loss)
        got = ds.train(batch, objective)
        after = dict(ds.named_weights())
    finally:
        ds.shutdown()
    want = local.train(batch, objective)
    worst = max(float((after[k] - v).abs().max()) for k, v in local.named_weights())
    return {"want": want, "got": got, "worst": worst}


def embedding_calls(run: Any) -> tuple[Any, list[list[int]]]:
    """``run()`` and the input shape of every embedding call with gradients (the updates') during it."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    shapes: list[list[int]] = []
    hook = register_module_forward_pre_hook(
        lambda module, args: shapes.append(list(args[0].shape))
        if isinstance(module, torch.nn.Embedding) and torch.is_grad_enabled() else None)
    try:
        return run(), shapes
    finally:
        hook.remove()


def checkpointing_case(tiny: str) -> dict[str, Any]:
    """ZeRO-3 under gradient checkpointing: every prompt cache made, and the updates' embedding calls."""
    from rlhf_plugins.models import prompt_cache

    made, make = [], prompt_cache.prompt_cache
    prompt_cache.prompt_cache = lambda model: made.append(make(model)) or made[-1]
    try:
        result, shapes = embedding_calls(lambda: one_update_each(tiny, {"gradient_checkpointing": True}, 3))
    finally:
        prompt_cache.prompt_cache = make
    return {**result, "caches": [cache is not None for cache in made], "shapes": shapes}


def _resume(path: str, learner: dict, stage: int, folder: str) -> dict[str, Any]:
    """Load ``folder`` into a new DeepSpeed learner: the error it raised, or the updates it restored."""
    ds = _deepspeed(path, learner, stage)
    try:
        ds.load_checkpoint(folder)
        return {"updates": ds.updates}
    except Exception as exc:  # noqa: BLE001 - what the test reads
        return {"error": type(exc).__name__, "line": str(exc)}
    finally:
        ds.shutdown()


def old_checkpoint_case(path: str, folder: str) -> dict[str, Any]:
    """ZeRO-2 and ZeRO-3 checkpoints whose optimizer decayed every parameter (one param group, as before
    biases and norms were left alone), loaded without --learner.weight_decay_all and with it."""
    from rlhf_plugins.algorithms import policy_losses
    from rlhf_plugins.algorithms.objective import Objective
    from rlhf_plugins.api import prepare

    old, results = {"weight_decay": 0.1, "weight_decay_all": True}, {}
    objective = Objective(policy_losses.ppo, prepare(_base(path, old), autoload=False)[0].algo.policy_loss)
    for stage in (2, 3):
        where, ds = str(Path(folder, f"zero{stage}")), _deepspeed(path, old, stage)
        try:
            batch = random_batch(group=4, prompts=3, seed=5)
            batch["advantages"], batch["old_logprobs"] = batch["action_mask"] * 0.5, ds.logprobs(batch)
            ds.train(batch, objective)
            ds.save_checkpoint(where)
        finally:
            ds.shutdown()
        results[f"zero{stage}"] = {"now": _resume(path, {"weight_decay": 0.1}, stage, where),
                                   "all": _resume(path, old, stage, where), "folder": where}
    return results


def adapter_gather_case(tiny: str) -> dict[str, Any]:
    """What ZeRO-3 gathers for an adapter sync (every GatheredParameters call recorded) and what it sends."""
    import deepspeed

    learner = _deepspeed(tiny, {}, 3, lora={"rank": 4}, sync={"method": "adapter"})
    gathered, real = [], deepspeed.zero.GatheredParameters

    def recording(params: Any, *args: Any, **kwargs: Any) -> Any:
        gathered.extend(params)
        return real(params, *args, **kwargs)

    deepspeed.zero.GatheredParameters = recording
    try:
        weights, config = learner.adapter_state()
    finally:
        deepspeed.zero.GatheredParameters = real
    params = list(learner.model.parameters())
    return {"gathered": len(gathered), "gathered_trained": sum(p.requires_grad for p in gathered),
            "trained": sum(p.requires_grad for p in params), "total": len(params), "names": sorted(weights),
            "r": config["r"], **_merged_held(learner)}


def _merged_held(learner: Any) -> dict[str, int]:
    """The merged export of a sharded LoRA learner: the most gathered tensors taken in before one went out."""
    held, most, sent, gather = 0, 0, 0, learner.raw_named_weights

    def counting() -> Any:
        nonlocal held
        for item in gather():
            held += 1
            yield item

    learner.raw_named_weights = counting
    for _ in learner.named_weights():
        most, held, sent = max(most, held), 0, sent + 1
    return {"merged_held": most, "merged_sent": sent}


def _each(cases: dict[str, Any]) -> dict[str, Any]:
    """Every case's result, or the error it raised (the others still run)."""
    results = {}
    for name, run in cases.items():
        try:
            results[name] = run()
        except Exception as exc:  # noqa: BLE001 - reported to the test that reads this case
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


def main(out: str) -> None:
    import tempfile

    from rlhf_plugins.testing import reduced_model_path, tiny_model_path

    tiny = tiny_model_path()
    with tempfile.TemporaryDirectory() as folder:
        gemma2 = gemma2_path(Path(folder))
        moe = reduced_model_path("qwen3-30b-a3b", layers=2, hidden=64)
        results = _each({
            "soft_cap_zero2": lambda: one_update_each(gemma2, {"logits_memory_mb": TWO_TOKENS_MB}, 2),
            "soft_cap_zero3": lambda: one_update_each(gemma2, {"logits_memory_mb": TWO_TOKENS_MB}, 3),
            "router_loss": lambda: one_update_each(moe, {"router_aux_loss_coef": 0.5}, 2),
            "weight_decay": lambda: one_update_each(gemma2, {"weight_decay": 0.5}, 3),
            "checkpointing": lambda: checkpointing_case(tiny),
            "adapter_gather": lambda: adapter_gather_case(tiny),
            "old_checkpoint": lambda: old_checkpoint_case(tiny, folder),
            "packed": lambda: dict(zip(("update", "shapes"), embedding_calls(
                lambda: one_update_each(tiny, {"max_tokens_per_micro_batch": 48}, 3)))),
        })
    if "update" in results["packed"]:
        results["packed"] = {**results["packed"].pop("update"), **results["packed"]}
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
