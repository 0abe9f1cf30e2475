"""The memory plan of a run: each role's analytic need, grouped into the processes the placement makes, next to
the memory of the node they are placed on -- printed by ``rlhf train --dry-run`` and at the start of every run,
and a layout whose minimum cannot fit is refused before anything starts, naming the flags that would make it fit.

None of OpenRLHF, verl or TRL plans memory before launch: there, a layout that cannot fit is found
out by the out-of-memory killer, minutes in.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from ..config.schema import Config
from ..config.validate import Plan
from ..errors import ConfigError
from ..models.logits import bytes_per_logit, chunk_tokens
from ..models.memory import DTYPE_BYTES, GIB, MemoryInputs, ModelShape, gib, reference_memory, streamed_staging
from .remedies import REMEDIES

#: resident memory of a process that imported torch and transformers, before any model (measured:
#: bench/scale.py); an engine's own libraries come as its memory model's ``imports`` item
PROCESS_IMPORTS = int(0.45 * GIB)
#: Ray's own processes on a node (GCS, raylet, dashboard agent; STACK.md)
RAY_NODE = int(1.3 * GIB)

#: above this share of the node's memory the plan's minimum is likely not enough in practice
TIGHT = 0.8
logger = logging.getLogger("rlhf_plugins")

#: items held only while a role works (forward, backward, generation): roles taking turns need the largest
TRANSIENT = frozenset({"activations", "logits chunk", "KV cache", "decode logits"})


@dataclass
class RoleNeed:
    role: str
    ranks: int
    #: bytes per rank, by item; empty when the component declares no memory model
    parts: dict[str, int] = field(default_factory=dict)
    known: bool = True
    #: fixed cost of the backend's own libraries (its memory model's ``imports`` item)
    imports: int = 0

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def working_set(self) -> int:
        return sum(v for k, v in self.parts.items() if k in TRANSIENT)


@dataclass
class ProcessNeed:
    roles: tuple[str, ...]
    #: processes of this kind (one per rank)
    count: int
    needs: list[RoleNeed]
    imports: int
    #: the roles work at the same time (asynchronous training), so their working sets add up
    concurrent: bool = False

    @property
    def name(self) -> str:
        return "+".join(self.roles) + (f" x{self.count}" if self.count > 1 else "")

    @property
    def analytic(self) -> int:
        """What the roles keep, plus the largest working set (or all of them when they overlap)."""
        kept = sum(n.total - n.working_set for n in self.needs)
        working = [n.working_set for n in self.needs] or [0]
        return kept + (sum(working) if self.concurrent else max(working))

    @property
    def total(self) -> int:
        """All processes of this kind: analytic need plus their imports."""
        return (self.analytic + self.imports) * self.count


@dataclass
class MemoryPlan:
    processes: list[ProcessNeed]
    #: memory of the node everything is placed on; None when the placement cannot say before launch
    node_bytes: int | None
    #: fixed memory of the placement itself (Ray's processes)
    fixed: int = 0
    workload: str = ""
    #: what to change for each kind of memory, for this run (REMEDIES without what it already does)
    remedies: dict[str, str] = field(default_factory=lambda: dict(REMEDIES))

    @property
    def roles(self) -> dict[str, RoleNeed]:
        return {n.role: n for p in self.processes for n in p.needs}

    @property
    def total(self) -> int:
        return sum(p.total for p in self.processes) + self.fixed

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(process, role, analytic need per rank, its largest items) per role."""
        out = []
        for p in self.processes:
            for n in p.needs:
                top = ", ".join(f"{k} {gib(v)}" for k, v in sorted(n.parts.items(), key=lambda kv: -kv[1])[:4])
                if not n.known:
                    top = "(its component declares no memory model)"
                out.append((p.name, n.role, gib(n.total) if n.known else "?", top or "nothing (rule functions)"))
        return out

    def summary(self) -> str:
        node = f" of the node's {gib(self.node_bytes)}" if self.node_bytes else " (node memory known after launch)"
        fixed = f" + Ray {gib(self.fixed)}" if self.fixed else ""
        imports = sum(p.imports * p.count for p in self.processes)
        return (f"memory plan: {gib(self.total)}{node} (analytic {gib(self.total - imports - self.fixed)} + "
                f"imports {gib(imports)}{fixed}; {self.workload})")

    def check(self) -> None:
        """Refuse a layout whose minimum exceeds the node's memory, naming what to change; warn when it
        leaves less than a fifth (processes hold more than their minimum: up to 1.15x measured)."""
        if self.node_bytes is None:
            return
        if self.total <= self.node_bytes:
            if self.total > TIGHT * self.node_bytes:
                logger.warning("the memory plan's minimum is %.0f%% of the node's memory; processes hold more than "
                               "their minimum (allocator, libraries: up to 1.15x measured), so this run may run out "
                               "of memory -- see the plan's largest items", 100 * self.total / self.node_bytes)
            return
        imports = sum(p.imports * p.count for p in self.processes)
        if imports > self.total - imports - self.fixed:
            count = sum(p.count for p in self.processes)
            raise ConfigError(f"this layout needs at least {gib(self.total)} and the node has {gib(self.node_bytes)}: "
                              f"{count} processes import torch and its libraries ({gib(imports)} in all) -- fewer "
                              "ranks (--ray.actor_workers, --ray.reference_workers, --ray.critic_workers, "
                              "--ray.reward_workers, --vllm.num_engines) or one process for several roles "
                              "(--ray.colocate hybrid)")
        biggest = max(self.processes, key=lambda p: p.total)
        role = max(biggest.needs, key=lambda n: n.total)
        items = sorted(role.parts.items(), key=lambda kv: -kv[1])[:2]
        fixes = "; ".join(f"{k} ({gib(v)}): {self.remedies.get(k, 'reduce it')}" for k, v in items)
        raise ConfigError(f"this layout needs at least {gib(self.total)} and the node has {gib(self.node_bytes)}: "
                          f"the largest is {role.role} ({gib(role.total)} per rank x {biggest.count}) -- {fixes}")


def memory_plan(config: Config, plan: Plan, prompt_tokens: int | None = None) -> MemoryPlan:
    """The plan of ``config`` for prompts of at most ``prompt_tokens`` (default: data.max_prompt_tokens),
    in batches as wide as ``--learner.pad_to_multiple_of`` makes them."""
    from ..models.tiny_model import default_model_path
    from .rollout import batch_widths, padded_width

    c = config
    shape = ModelShape.of_folder(c.model.path or default_model_path(quiet=True), c.model.trust_remote_code)
    widths = batch_widths(c, plan)
    budget, completion = widths["budgets"]
    prompt = padded_width(prompt_tokens, widths["multiple"], budget) if prompt_tokens else budget
    groups = [(roles, plan.engine_workers if roles == ("generation",) else n)
              for roles, n in plan.placement.process_groups(c, plan.roles)]
    ranks = {role: n for roles, n in groups for role in roles}
    reference = c.model.reference_path  # a reference model of its own has its own size
    shapes = {"reference": ModelShape.of_folder(reference, c.model.trust_remote_code)} if reference else {}
    needs = {r: _role_need(c, plan, shapes.get(r, shape), r, ranks[r], prompt, completion) for r in plan.roles}
    if "generation" in needs and shares_weights(c, plan):
        parts = needs["generation"].parts
        parts["weights (the actor's, shared)"] = parts.pop("weights", 0) * 0
    for role in plan.sync.staging:  # a whole extra copy of the weights while a sync is under way
        if role in needs and needs[role].known:
            needs[role].parts["sync staging"] = _sync_copy(c, plan, shape, needs[role], role)
    processes = [ProcessNeed(roles, n, [needs[r] for r in roles],
                             _imports(c, roles) + sum(needs[r].imports for r in roles),
                             concurrent=c.train.max_staleness > 0) for roles, n in groups]
    node = plan.placement.memory_of_node(c)
    fixed = RAY_NODE if not plan.placement.same_process else 0
    batch = c.train.prompts_per_step * c.generation.n_samples_per_prompt
    workload = (f"{batch} sequences of up to {prompt} + {completion} tokens, {shape.parameters / 1e6:.3g}M "
                f"parameters in {c.model.dtype}")
    return MemoryPlan(processes, node, fixed if node is not None else 0, workload, remedies(c, plan))


def remedies(c: Config, plan: Plan) -> dict[str, str]:
    """:data:`REMEDIES` less what the run already does: a learner that already shards a kind of memory
    (``LearnerBackend(shards=...)``: ZeRO's stages, FSDP2) is told to spread it over more ranks, not to
    shard it."""
    out = dict(REMEDIES)
    if c.learner.gradient_checkpointing:
        out["activations"] = ("a smaller micro batch (--learner.micro_batch_size, --learner.max_tokens_per_micro_"
                              "batch, which also bounds the reference's forward)")
    stage = plan.learner.shards(c) if plan.learner.shards is not None else 0
    if stage == 0:
        return out
    more = "spread them over more ranks (--ray.actor_workers)"
    out["optimizer states"] = f"{more}, or train adapters only (--lora.rank 16)"
    if stage >= 2:
        out["gradients"] = f"{more} or --lora.rank 16"
    if stage == 3:
        out["weights"] = more + ("" if c.model.dtype != "float32" else ", or --model.dtype bfloat16")
    return out


def _sync_copy(c: Config, plan: Plan, shape: ModelShape, need: RoleNeed, role: str) -> int:
    """A copy of the weights in the role's dtype (less where the engine loads a sync as it arrives)."""
    whole = need.parts.get("weights") or shape.parameters * DTYPE_BYTES[c.model.dtype]
    streams = role == "generation" and plan.engine.streams_weights
    return streamed_staging(shape, whole, int(c.sync.bucket_mb * 2**20)) if streams else whole


def shares_weights(config: Config, plan: Plan) -> bool:
    """Whether the engine will read the learner's own parameters (no second copy in the process)."""
    share = plan.sync.shares_weights
    return (share is not None and bool(share(config)) and plan.engine.supports_shared_weights
            and plan.learner.live_weights and plan.placement.in_one_process(config))


def _imports(c: Config, roles: tuple[str, ...]) -> int:
    if roles == ("reward",) and not c.reward.models:
        return 0  # rule rewards: that process never imports torch
    return PROCESS_IMPORTS


def _role_need(c: Config, plan: Plan, shape: ModelShape, role: str, ranks: int, prompt: int,
               completion: int) -> RoleNeed:
    batch = c.train.prompts_per_step * c.generation.n_samples_per_prompt
    inputs = _inputs(c, shape, role, ranks, batch, prompt, completion, plan)
    if role in ("actor", "critic"):
        fn = plan.learner.memory
    elif role == "generation":
        fn = plan.engine.memory
        inputs = dataclasses.replace(inputs, sequences=-(-batch // max(1, plan.engine_workers)))
    elif role == "reference":
        fn = plan.learner.memory if plan.learner.shards_reference else reference_memory
    else:
        return _reward_need(c, shape, ranks)
    if fn is None:
        return RoleNeed(role, ranks, known=False)
    from .._lazy import resolve

    parts = {k: int(v) for k, v in resolve(fn)(inputs).items()}
    return RoleNeed(role, ranks, parts, imports=parts.pop("imports", 0))


def _reward_need(c: Config, shape: ModelShape, ranks: int) -> RoleNeed:
    parts = {}
    for i, path in enumerate(c.reward.models):
        try:
            parts[f"reward model {i + 1}"] = ModelShape.of_folder(path).parameters * MemoryInputs(
                c, shape, "reward", 1, 0, 0, 0).dtype_bytes
        except Exception:  # a reward-model folder that is not a causal LM: its size from its files
            parts[f"reward model {i + 1}"] = _folder_bytes(path)
    return RoleNeed("reward", ranks, parts)


def _folder_bytes(path: str) -> int:
    from pathlib import Path

    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def _inputs(c: Config, shape: ModelShape, role: str, ranks: int, batch: int, prompt: int, completion: int,
            plan: Plan) -> MemoryInputs:
    per_rank = -(-batch // ranks)
    learner = c.learner
    if role == "reference":
        micro_samples = per_rank
    else:
        mini = -(-(learner.mini_batch_size or batch) // ranks)
        micro_samples = min(learner.micro_batch_size or mini, mini)
    tokens = micro_samples * (prompt + completion)
    if learner.max_tokens_per_micro_batch:
        tokens = min(tokens, max(learner.max_tokens_per_micro_batch, prompt + completion))
    scored = micro_samples * completion  # tokens whose logits are computed
    chunk = chunk_tokens(shape.vocab, learner.logits_memory_mb, shape.logit_softcap)
    logits = min(scored, chunk or scored) * shape.vocab * bytes_per_logit(shape.logit_softcap)
    if role == "critic":
        logits = 0
    trainable = _trainable(c, shape, role)
    backend = plan.engine if role == "generation" else plan.learner if role in ("actor", "critic") else None
    section = c.extra.get(backend.name) if backend is not None else None  # the backend's own settings
    options = dict(vars(section)) if section is not None else {}
    return MemoryInputs(c, shape, role, ranks, trainable, tokens, logits, batch, prompt, completion, options)


def _trainable(c: Config, shape: ModelShape, role: str) -> int:
    lora = c.extra.get("lora")
    if lora is None or not (lora.rank or lora.config) or (role == "critic" and not lora.critic):
        return shape.parameters
    rank = lora.rank or 16
    # every linear layer of every decoder layer adapted (all-linear): r x (in + out) each
    per_layer = rank * (2 * shape.hidden + shape.q_dim + 2 * (shape.hidden + shape.kv_dim) + shape.q_dim
                        + shape.hidden + 3 * (shape.hidden + shape.intermediate))
    return per_layer * shape.layers


def show(plan: MemoryPlan, console: Any) -> None:
    """The plan: a summary line, then each role's need per rank with its largest items."""
    from rich.markup import escape

    console.print(escape(plan.summary()), highlight=False, soft_wrap=True)
    for process, role, need, items in plan.rows():
        where = f"[{process}] " if process != role else ""
        console.print(escape(f"  {where}{role} {need}: {items}"), highlight=False, soft_wrap=True)
