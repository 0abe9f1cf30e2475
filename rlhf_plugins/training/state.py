"""The trainer's checkpoint: what every role writes, the loop's own state, plugin state.

A checkpoint holds ``actor/`` and ``critic/`` (each learner's ``save_checkpoint``: weights as
safetensors, optimizer, counters, random state; DeepSpeed's own ZeRO partitions, one set per
rank), ``trainer.pt`` (step, prompt sampler position, KL controller, reward normaliser, the
driver's python / numpy / torch random states) and ``plugins.json`` (what each plugin's
``rlhf_state_dict`` returned). Generation needs no state: the engine's sampling seed is derived
from the run seed and the step, and its weights come from the actor by a sync after loading.

Also the run's summary (``summary.json``) and how it is printed at the end.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import checkpoint
from .reference_sync import load_reference, save_reference

if TYPE_CHECKING:
    from rich.console import Console

    from .loop import Trainer


def loop_state(t: Trainer) -> dict[str, Any]:
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "step": t.step_count,
        # asynchronous training: the sampler has run ahead; record where the learner's next rollout began
        "sampler": dict(t.sampler_position if t.sampler_position is not None else t.sampler.state_dict()),
        "kl_controller": dict(t.kl_control.state_dict()),
        "entropy_controller": dict(t.entropy_control.state_dict()),
        "reward_shaper": json.loads(json.dumps(t.shaper.state_dict())),
        "python_rng": random.getstate(),
        "numpy_rng": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch_rng": torch.get_rng_state(),
        "best": dict(t.best) if t.best else None,
    }


def restore_loop_state(t: Trainer, state: dict[str, Any]) -> None:
    import numpy as np

    t.step_count = int(state["step"])
    t.sampler.load_state_dict(state["sampler"])
    t.kl_control.load_state_dict(state["kl_controller"])
    if "entropy_controller" in state:  # checkpoints from before the adaptive entropy bonus
        t.entropy_control.load_state_dict(state["entropy_controller"])
    t.shaper.load_state_dict(state["reward_shaper"])
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch_rng"])
    t.best = state.get("best")


def save_checkpoint(t: Trainer, run_dir: Path, keep: int, snapshot: dict[str, Any] | None = None) -> Path:
    state = snapshot or loop_state(t)

    def fill(tmp: Path) -> dict[str, Any]:
        tmp = tmp.resolve()  # roles may run in processes with another working directory
        with t.learner_lock:  # not while the rollout worker syncs weights out of the actor
            t.actor.save_checkpoint(str(tmp / "actor"))
            if t.critic is not None:
                t.critic.save_checkpoint(str(tmp / "critic"))
        moved = save_reference(t, tmp / "reference")  # a reference that moves towards the policy
        torch.save(state, tmp / "trainer.pt")
        (tmp / "plugins.json").write_text(json.dumps(t.pm.collect_state(), indent=1))
        return {"roles": ["actor", *(["critic"] if t.critic is not None else []), *(["reference"] if moved else [])]}

    max_bytes = math.ceil(t.config.train.keep_checkpoints_gb * 2**30)  # any size limit above 0 is one
    return checkpoint.write(run_dir, int(state["step"]), fill, keep, max_bytes)


def load_checkpoint(t: Trainer, path: Path) -> int:
    manifest = checkpoint.verify(path)
    path = path.resolve()
    t.stop_worker()  # rollouts made ahead came from the weights being replaced: regenerated after loading
    roles = manifest.get("roles", ["actor"])
    if ("critic" in roles) != (t.critic is not None):
        raise checkpoint.CheckpointError(
            f"checkpoint '{path}' was written {'with' if 'critic' in roles else 'without'} a critic, "
            f"but this run has {'one' if t.critic is not None else 'none'}"
        )
    t.actor.load_checkpoint(str(path / "actor"))
    if t.critic is not None:
        t.critic.load_checkpoint(str(path / "critic"))
    state = torch.load(path / "trainer.pt", weights_only=True)
    if "reference" in roles and t.reference is not None and t.config.algo.kl.ref_sync_steps:
        load_reference(t, path / "reference")
    elif t.config.algo.kl.ref_sync_steps and int(state["step"]) >= t.config.algo.kl.ref_sync_steps:
        raise checkpoint.CheckpointError(
            f"checkpoint '{path}' holds no reference model, but this run moves its reference every "
            f"{t.config.algo.kl.ref_sync_steps} steps (--algo.kl.ref_sync_steps) and is past the first move; resume "
            "with the settings the checkpoint was written with")
    restore_loop_state(t, state)
    plugins = path / "plugins.json"
    t.pm.restore_state(json.loads(plugins.read_text()) if plugins.is_file() else {})
    t.sync.sync(t.actor, t.engine, t.step_count)  # the engine generates with the restored policy
    t.engine_version = t.step_count
    return t.step_count


def save_final(trainer: Trainer, out: Path, with_critic: bool = True, averaged: bool = True) -> None:
    """The policy (and the critic, beside it in ``critic/``) as ``save_pretrained`` folders, each
    written to a temporary folder and renamed into place: a failed save leaves no folder that
    looks loadable."""
    import os
    import shutil

    from ..errors import UsageError

    out = out.resolve()  # roles may run in processes with another working directory
    critic = with_critic and trainer.critic is not None
    targets = [(out, trainer.actor)] + ([(out.parent / "critic", trainer.critic)] if critic else [])
    for target, role in targets:
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            (role.save_average if role is trainer.actor and averaged else role.save)(str(tmp))  # --learner.ema
            if role is trainer.actor:
                trainer.tokenizer.save_pretrained(str(tmp))
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise UsageError(f"cannot save the final model to '{target}': {exc.strerror or exc}; the checkpoints "
                             "are kept (free space, then resume)") from exc


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def summary(trainer: Any) -> dict[str, Any]:
    """First-10% vs last-10% mean reward and seconds per step, over every step of the run (a resumed
    run includes the steps before the resume); the first and last evaluation; each process's peak
    memory beside its analytic minimum."""
    from .memory_watch import summary as memory_summary

    rewards = [m["reward/mean"] for m in trainer.history]
    k = max(1, len(rewards) // 10)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    times = [m["time/step"] for m in trainer.history]
    out: dict[str, Any] = {
        "steps": len(rewards),
        "reward_first_10pct": first,
        "reward_last_10pct": last,
        "reward_gain": last - first,
        "seconds_per_step": sum(times) / max(len(times), 1),
    }
    if trainer.eval_history:  # the first and the last evaluation, {"step": ..., "eval/...": ...}
        out["eval_first"], out["eval_last"] = trainer.eval_history[0], trainer.eval_history[-1]
    if trainer.best:
        out["best"] = trainer.best
    out["memory"] = memory_summary(trainer.history, getattr(trainer, "memory_plan", None))
    return out


def print_summary(console: Console, summary: dict[str, Any], run_dir: Path) -> None:
    """The closing lines of a run: reward first -> last, held-out first -> last, the best kept."""
    saved = summary["final_model"]
    console.print(
        f"mean reward: first 10% of steps {summary['reward_first_10pct']:.3f} -> last 10% "
        f"{summary['reward_last_10pct']:.3f} ({summary['reward_gain']:+.3f}); "
        f"{summary['seconds_per_step']:.2f} s/step; "
        + (f"policy saved to {saved}" if saved else "policy not saved (train.save_final false)"),
        highlight=False, soft_wrap=True,
    )
    if "eval_first" in summary:
        first, last = summary["eval_first"], summary["eval_last"]
        changes = "  ".join(f"{k.removeprefix('eval/')} {first.get(k, float('nan')):.3f} -> {v:.3f}"
                            for k, v in last.items() if k.startswith("eval/"))
        console.print(f"held-out, step {first['step']} -> {last['step']}: {changes}", highlight=False,
                      soft_wrap=True)
    if "best" in summary:
        b = summary["best"]
        console.print(f"best {b['metric']} {b['value']:.3f} after {b['step']} steps, kept in {run_dir / 'best'}",
                      highlight=False, soft_wrap=True)
