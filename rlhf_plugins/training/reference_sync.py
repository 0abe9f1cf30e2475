"""Moving the reference model towards the policy during training (``--algo.kl.ref_sync_steps N``):
every N steps, after the update, ``reference = alpha x policy + (1 - alpha) x reference``
(``--algo.kl.ref_mixup_alpha``), the rule of TR-DPO that TRL's ``sync_ref_model`` applies. The KL term
then holds the policy near a recent policy instead of the initial one.

It works whatever the placement: every actor rank iterates its ``named_weights`` (ZeRO-3 gathers
are collective), rank 0 sends CPU copies (in the dtype the learner exports) in buckets of at most
:data:`BUCKET_BYTES` to every reference rank (the role's ``endpoints``: in this process, or Ray
actors), and each mixes them into its whole model in place (``torch.lerp``, in the reference's dtype
as TRL's in-place update is). Where one Ray actor holds both roles (``--ray.colocate hybrid``) the
actor's tensors are mixed in there, nothing sent. A reference sharded by its learner (FSDP2's
``shards_reference``) mixes in, on each rank, the rows of every tensor that rank holds.

Checkpoints of such a run hold the reference's weights (``reference/``), so a resume continues with the
reference the run had, not the initial policy."""
from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..protocols import RankContext
    from .loop import Trainer

#: at most this many bytes of weights travel to the reference per call
BUCKET_BYTES = 256 << 20


def refresh_due(config: Any, step: int) -> bool:
    """Whether the reference moves after step ``step`` (0-based): after steps N, 2N, ..."""
    every = config.algo.kl.ref_sync_steps
    return every > 0 and (step + 1) % every == 0


def refresh_reference(trainer: Trainer, step: int) -> dict[str, float]:
    """Mix the policy's weights into the reference (when due after ``step``); the step's metrics."""
    if trainer.reference is None or not refresh_due(trainer.config, step):
        return {}
    start = time.perf_counter()
    alpha = trainer.config.algo.kl.ref_mixup_alpha
    actor, reference = trainer.actor, trainer.reference
    hosted_with = getattr(actor, "hosted_with", None)
    if callable(hosted_with) and hosted_with(reference):  # one process holds both (--ray.colocate hybrid)
        sent = [actor.run_with(reference, partial(_mix_beside, alpha=alpha))]
    else:
        sent = [n for n in actor.run(_send, reference.endpoints(), alpha) if n]
    return {"reference/refreshed": 1.0, "reference/tensors": float(sent[0] if sent else 0),
            "time/reference_refresh": time.perf_counter() - start}


def _mix_beside(actor: Any, reference: Any, alpha: float) -> int:
    """In the process that hosts both roles: the actor's weights into its reference, no copies sent."""
    from ..models.weights import load_named_weights

    return load_named_weights(reference.backend, actor.named_weights(), mix=alpha,
                              receiver="the reference model")["tensors"]


def _send(ctx: RankContext, endpoints: list[Any], alpha: float) -> int:
    """Every actor rank walks the weights; rank 0 sends them bucket by bucket to every reference rank."""
    named = ctx.backend.named_weights()
    if ctx.rank != 0:
        for _ in named:
            pass
        return 0
    count, bucket, size, handles = 0, [], 0, []
    for name, tensor in named:
        bucket.append((name, tensor.detach().to("cpu", copy=True)))
        size += tensor.numel() * tensor.element_size()
        count += 1
        if size >= BUCKET_BYTES:
            handles += [endpoint.submit(_mix, bucket, alpha) for endpoint in endpoints]
            bucket, size = [], 0
    if bucket:
        handles += [endpoint.submit(_mix, bucket, alpha) for endpoint in endpoints]
    endpoints[0].wait(handles)
    return count


def _mix(ctx: RankContext, named: list[tuple[str, torch.Tensor]], alpha: float) -> int:
    """Into this reference rank: its whole model, or its shards (a reference built on a learner that
    shards it, FSDP2)."""
    from ..models.empty_init import mix_into_shards
    from ..models.weights import load_named_weights

    if not isinstance(ctx.backend, torch.nn.Module):  # the sharding learner, built frozen
        return mix_into_shards(ctx.backend.model, named, alpha)
    return load_named_weights(ctx.backend, named, mix=alpha, receiver="the reference model")["tensors"]


def save_reference(trainer: Trainer, folder: Path) -> bool:
    """The reference's weights into ``folder`` (a checkpoint's ``reference/``) when the run moves it:
    rank 0's whole model, or a sharded one gathered by its learner (every rank takes part)."""
    if trainer.reference is None or not trainer.config.algo.kl.ref_sync_steps:
        return False
    trainer.reference.run(_save, str(folder))
    return True


def load_reference(trainer: Trainer, folder: Path) -> None:
    """Every reference rank's model (or shards) from a checkpoint's ``reference/`` folder."""
    trainer.reference.run(_load, str(folder))


def _save(ctx: RankContext, folder: str) -> None:
    from huggingface_hub import save_torch_state_dict

    from ..models.folder import SHARD_BYTES

    if not isinstance(ctx.backend, torch.nn.Module):
        ctx.backend.save(folder)  # collective gathers; rank 0 writes
    elif ctx.rank == 0:
        Path(folder).mkdir(parents=True, exist_ok=True)
        save_torch_state_dict(ctx.backend.state_dict(), folder, max_shard_size=SHARD_BYTES)


def _load(ctx: RankContext, folder: str) -> None:
    from ..models.empty_init import checkpoint_tensors, mix_into_shards
    from ..models.folder import load_shards

    with torch.no_grad():
        if isinstance(ctx.backend, torch.nn.Module):
            return load_shards(ctx.backend, folder)
        from safetensors.torch import load_file

        for file in sorted({f for f, _ in checkpoint_tensors(folder).values()}):
            mix_into_shards(ctx.backend.model, load_file(str(Path(folder) / file)).items(), 1.0)
