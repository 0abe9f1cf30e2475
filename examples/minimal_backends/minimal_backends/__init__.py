"""A generation engine, a learner and a weight-sync method written from rlhf-plugins' protocols
alone: everything imported from ``rlhf_plugins`` is public, nothing builtin is subclassed."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

from rlhf_plugins import (
    BackendContext,
    GenerationBackend,
    LearnerBackend,
    RankContext,
    Samples,
    SamplingParams,
    WeightSyncMethod,
    hookimpl,
    on_model_workers,
)

__version__ = "0.1.0"


def _positions(mask: Any) -> Any:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _completion_logprobs(model: Any, batch: dict[str, Any], temperature: float) -> Any:
    """Log-probs of the completion tokens: one full forward, no prefix sharing."""
    import torch

    seq, mask = batch["sequences"], batch["attention_mask"]
    T = batch["action_mask"].shape[1]
    logits = model(input_ids=seq, attention_mask=mask, position_ids=_positions(mask)).logits
    logits = logits[:, -T - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, seq[:, -T:, None]).squeeze(-1)


class SimpleEngine:
    """Samples token by token with a full forward each time (slow, obviously correct)."""

    def __init__(self, ctx: BackendContext) -> None:
        from transformers import AutoTokenizer

        self.model = ctx.load_model().eval().requires_grad_(False)
        tok = AutoTokenizer.from_pretrained(ctx.model_path)
        self.pad, self.eos = tok.pad_token_id, tok.eos_token_id

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Samples:
        import torch

        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
        out = Samples()
        for i, prompt in enumerate(prompt_ids):
            for _ in range(params.n):
                tokens, logps, reason = [], [], "length"
                with torch.no_grad():
                    for _ in range(params.max_new_tokens):
                        ids = torch.tensor([prompt + tokens])
                        logits = self.model(input_ids=ids).logits[0, -1].float() / params.temperature
                        logp = torch.log_softmax(logits, -1)
                        token = int(torch.multinomial(logp.exp(), 1, generator=gen))
                        tokens.append(token)
                        logps.append(float(logp[token]))
                        if token == self.eos:
                            reason = "stop"
                            break
                out.prompt_index.append(i)
                out.completion_ids.append(tokens)
                out.logprobs.append(logps)
                out.finish_reasons.append(reason)
        return out

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {k: (tuple(v.shape), str(v.dtype)) for k, v in self.model.state_dict().items()}

    def load_weights(self, named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        import torch

        state = self.model.state_dict()
        count = 0
        with torch.no_grad():
            for name, tensor in named:
                state[name].copy_(tensor)
                count += 1
        return {"tensors": count}

    def shutdown(self) -> None:
        self.model = None


class SimpleLearner:
    """AdamW over the whole rollout, one optimizer step per call to train."""

    def __init__(self, ctx: BackendContext) -> None:
        import torch

        if ctx.role != "actor":
            raise ValueError("the simple learner trains the actor only")
        self.model = ctx.load_model()
        self.temperature = ctx.config.generation.temperature
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=ctx.config.learner.lr)

    def logprobs(self, batch: dict[str, Any]) -> Any:
        import torch

        with torch.no_grad():
            return _completion_logprobs(self.model, batch, self.temperature)

    def train(self, batch: dict[str, Any], objective: Any) -> dict[str, float]:
        self.model.train()
        loss, metrics = objective({"logprobs": _completion_logprobs(self.model, batch, self.temperature)}, batch)
        (loss * float(batch.get("dp_weight", 1.0))).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.model.eval()
        return {k: float(v) for k, v in metrics.items()}

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def save(self, path: str) -> None:
        self.model.save_pretrained(path)

    def save_checkpoint(self, path: str) -> None:
        import torch
        from safetensors.torch import save_model

        os.makedirs(path, exist_ok=True)
        save_model(self.model, os.path.join(path, "model.safetensors"))
        torch.save(self.optimizer.state_dict(), os.path.join(path, "optimizer.pt"))

    def load_checkpoint(self, path: str) -> None:
        import torch
        from safetensors.torch import load_model

        load_model(self.model, os.path.join(path, "model.safetensors"))
        self.optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True))

    def shutdown(self) -> None:
        pass


# --- a weight-sync method: both ends in this module ---------------------------------------------


def _write(ctx: RankContext, path: str) -> int:
    from safetensors.torch import save_file

    tensors = {name: t.contiguous().cpu() for name, t in ctx.backend.named_weights()}  # every rank iterates
    if ctx.rank == 0:
        save_file(tensors, path + ".tmp")
        os.replace(path + ".tmp", path)
    return len(tensors)


def _load_on_worker(worker: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    return worker.load_weights(tensors.items())


def _read(ctx: RankContext, path: str) -> int:
    from safetensors.torch import load_file

    tensors = load_file(path)
    on_model_workers(ctx.backend, _load_on_worker, tensors)
    return len(tensors)


class FileSync:
    """The actor's rank 0 writes the weights to one safetensors file; every engine reads it. The
    file lives in a temporary folder for the one sync (removed after it, whatever happens)."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def sync(self, actor: Any, engine: Any, step: int) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="rlhf-file-sync-") as folder:
            path = os.path.join(folder, "weights.safetensors")
            written = actor.run(_write, path)[0]
            read = engine.run(_read, path)
            return {"tensors": written, "rpcs": 1 + len(read), "bytes": os.path.getsize(path)}


@hookimpl
def rlhf_generation_backends() -> Iterable[GenerationBackend]:
    yield GenerationBackend("simple", factory=SimpleEngine, description="full-forward sampling, no KV cache")


@hookimpl
def rlhf_learner_backends() -> Iterable[LearnerBackend]:
    yield LearnerBackend("simple", factory=SimpleLearner, description="AdamW on the whole rollout")


@hookimpl
def rlhf_weight_sync_methods() -> Iterable[WeightSyncMethod]:
    yield WeightSyncMethod("file", factory=FileSync, description="weights through a safetensors file")
