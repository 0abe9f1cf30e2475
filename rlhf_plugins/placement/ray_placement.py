"""Ray placement: one placement group per role (or per colocated set of roles),
N Ray actors per role forming a torch.distributed group, method calls dispatched
to them so the training loop cannot tell them from local objects."""
from __future__ import annotations

import inspect
import logging
import os
from collections import Counter
from typing import Any

import torch

from ..errors import UsageError
from ..manager import pickle_file_plugins_by_value
from .ray_cluster import check_capacity, check_options, connect, release, reserve

logger = logging.getLogger("rlhf_plugins")

#: roles that share one placement group (and split each bundle's GPU and CPU) per mode
COLOCATE = {
    "none": (),
    "actor_ref": (("actor", "reference"),),
    "critic_reward": (("critic", "reward"),),
    "all": (("actor", "reference", "critic", "reward", "generation"),),
}
#: environment a worker inherits from the driver (local clusters would, remote ones do not)
NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
FORWARDED_ENV = ("RLHF_CACHE_DIR", "RLHF_DISABLE_PLUGIN_AUTOLOAD", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                 "TOKENIZERS_PARALLELISM", "TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR", "PYTHONPATH", NOSET_ENV)


class RoleWorker:
    """The Ray actor behind one rank of a role: sets the distributed environment,
    constructs the role object, and runs its methods."""

    def __init__(self, role: str, rank: int, world_size: int) -> None:
        self.role, self.rank, self.world_size = role, rank, world_size
        self.obj: Any = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_address(self) -> tuple[str, int]:
        from ..sync.groups import free_address

        return free_address()

    def sync_backend(self) -> str:
        from ..sync.groups import default_backend

        return default_backend()

    def setup(self, cls: type, args: tuple, kwargs: dict, env: dict[str, str], threads: int = 1) -> bool:
        import ray

        # colocated roles take turns on their bundle, so each may use all of its CPUs
        torch.set_num_threads(max(1, threads))
        gpu_ids = ray.get_gpu_ids()
        if gpu_ids:
            # one visible GPU per actor, unless Ray was told not to touch *_VISIBLE_DEVICES
            env["LOCAL_RANK"] = str(int(gpu_ids[0])) if os.environ.get(NOSET_ENV) else "0"
        os.environ.update(env)
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.obj = cls(*args, **kwargs)
        return True

    def env_info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES")
        return {
            **{k: os.environ.get(k) for k in keys},
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "node_id": ctx.get_node_id(),
            "placement_group_id": ctx.get_placement_group_id(),
            "resources": ctx.get_assigned_resources(),
            "dist_initialized": torch.distributed.is_available() and torch.distributed.is_initialized(),
        }

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        target = getattr(self.obj, method, None)
        if target is None:
            target = getattr(self, method)
        out = target(*args, **kwargs)
        if inspect.isgenerator(out):
            out = list(out)
        return out

    def shutdown(self) -> None:
        stop = getattr(self.obj, "shutdown", None)
        if callable(stop):
            stop()


def _unwrap(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, UsageError) else exc


def get(refs: Any) -> Any:
    """``ray.get`` that re-raises a user error from a worker as itself (one line for the CLI)."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        cause = _unwrap(exc)
        if cause is not exc:
            raise cause from None
        raise


class RayEndpoint:
    """One worker, addressable from anywhere (it pickles as its actor handle)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.handle.call.remote(method, args, kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return get(self.submit(method, *args, **kwargs))

    @staticmethod
    def wait(futures: list[Any]) -> list[Any]:
        return get(futures)


def shard_batch(batch: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """``n`` consecutive shards with whole prompt groups in each."""
    B = batch["sequences"].shape[0]
    group = int(batch.get("group_size", 1))
    groups = B // group if B % group == 0 else B
    unit = group if B % group == 0 else 1
    sizes = [groups // n + (1 if i < groups % n else 0) for i in range(n)]
    shards, start = [], 0
    for size in sizes:
        stop = start + size * unit
        shards.append({k: v[start:stop] if torch.is_tensor(v) or isinstance(v, list) else v for k, v in batch.items()})
        start = stop
    return shards


def balance(loads: list[int], n: int) -> list[list[int]]:
    """Indices split into ``n`` shares of about equal total load (longest first, to the lightest)."""
    shares: list[list[int]] = [[] for _ in range(n)]
    totals = [0] * n
    for i in sorted(range(len(loads)), key=lambda i: -loads[i]):
        k = totals.index(min(totals))
        shares[k].append(i)
        totals[k] += loads[i]
    return [sorted(s) for s in shares]


def merge(results: list[Any]) -> Any:
    first = results[0]
    if torch.is_tensor(first):
        return torch.cat(results)
    if isinstance(first, dict) and all(isinstance(v, (int, float)) for v in first.values()):
        return {k: sum(r[k] for r in results) / len(results) for k in first}
    return first


class RoleGroup:
    """N workers of one role; methods dispatch as the role class declares (see ``roles.dispatch``)."""

    def __init__(self, role: str, cls: type, workers: list[Any]) -> None:
        self.role, self.cls, self.workers = role, cls, workers

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not hasattr(self.cls, name):
            raise AttributeError(name)
        mode = getattr(getattr(self.cls, name), "__rlhf_dispatch__", "one")

        def remote_method(*args: Any, **kwargs: Any) -> Any:
            return self._dispatch(name, mode, args, kwargs)

        return remote_method

    def _dispatch(self, name: str, mode: str, args: tuple, kwargs: dict) -> Any:
        if mode == "one" or len(self.workers) == 1 and mode != "split":
            return get(self.workers[0].call.remote(name, args, kwargs))
        if mode == "all":
            return get([w.call.remote(name, args, kwargs) for w in self.workers])[0]
        if mode == "prompts":
            return self._generate_balanced(name, args, kwargs)
        batch, rest = args[0], args[1:]
        shards = shard_batch(batch, len(self.workers))
        weigh = getattr(rest[0], "weight", None) if rest else None
        refs = []
        for worker, shard in zip(self.workers, shards):
            if callable(weigh):  # each rank's share of the global loss (DeepSpeed averages over ranks)
                shard["dp_weight"] = weigh(shard["action_mask"], batch["action_mask"]) * len(self.workers)
            refs.append(worker.call.remote(name, (shard, *rest), kwargs))
        return merge(get(refs))

    def _generate_balanced(self, name: str, args: tuple, kwargs: dict) -> Any:
        """Prompts to engines by load (prompt tokens), results back in prompt order."""
        from ..engines import Samples

        prompts, rest = args[0], args[1:]
        shares = balance([len(p) for p in prompts], len(self.workers))
        refs = [w.call.remote(name, ([prompts[i] for i in idx], *rest), kwargs) for w, idx in zip(self.workers, shares)
                if idx]
        parts = get(refs)
        rows = []
        for idx, part in zip([s for s in shares if s], parts):
            for j in range(len(part)):
                rows.append((idx[part.prompt_index[j]], j, part, j))
        rows.sort(key=lambda r: (r[0], r[1]))
        out = Samples()
        for prompt, _, part, j in rows:
            out.prompt_index.append(prompt)
            out.completion_ids.append(part.completion_ids[j])
            out.logprobs.append(part.logprobs[j])
            out.finish_reasons.append(part.finish_reasons[j])
        return out

    def endpoints(self) -> list[RayEndpoint]:
        return [RayEndpoint(w) for w in self.workers]

    def env_info(self) -> list[dict[str, Any]]:
        return get([w.env_info.remote() for w in self.workers])


class RayPlacement:
    """``--placement.strategy ray``."""

    same_process = False

    def __init__(self, config: Any, plugin_spec: Any, roles: tuple[str, ...] = ("actor", "generation")) -> None:
        import ray

        self.opts = opts = config.section("ray")
        check_options(opts)
        self.started = connect(opts)
        self._ray = ray
        pickle_file_plugins_by_value()
        backend_opts = config.extra.get(config.generation.backend)  # e.g. the vllm section
        self.workers_of = {
            "actor": opts.actor_workers,
            "critic": opts.critic_workers,
            "reference": opts.reference_workers,
            "generation": int(getattr(backend_opts, "num_engines", 1)),
            "reward": 1,
        }
        self.roles = tuple(roles)
        self.layout = self._layout()
        self.groups: dict[str, RoleGroup] = {}
        self.pgs: dict[str, Any] = {}
        check_capacity({key: bundles for key, (_, bundles) in self.layout.items()})
        for key, (members, bundles) in self.layout.items():
            self.pgs[key] = reserve(bundles, opts.strategy, opts.ready_timeout, name=f"rlhf-{key}")

    def _layout(self) -> dict[str, tuple[tuple[str, ...], list[dict[str, float]]]]:
        """Placement group key -> (roles in it, bundles)."""
        o = self.opts
        sets = [tuple(r for r in s if r in self.roles) for s in COLOCATE[o.colocate]]
        sets = [s for s in sets if s]
        grouped = {r for s in sets for r in s}
        sets += [(r,) for r in self.roles if r not in grouped]
        layout = {}
        for members in sets:
            n = max(self.workers_of[r] for r in members)
            gpu = o.gpus_per_worker if (len(members) > 1 or members[0] != "reward") else 0.0
            bundle = {"CPU": float(o.cpus_per_worker)}
            if gpu > 0:
                bundle["GPU"] = float(gpu)
            layout["+".join(members)] = (members, [dict(bundle) for _ in range(n)])
        return layout

    def _slot(self, role: str) -> tuple[Any, dict[str, float], int]:
        for key, (members, bundles) in self.layout.items():
            if role in members:
                share = {k: v / len(members) for k, v in bundles[0].items()}
                return self.pgs[key], share, len(members)
        raise UsageError(f"ray placement has no slot for role '{role}'; expected one of {', '.join(self.roles)}")

    def create_role(self, role: str, cls: type, *args: Any, **kwargs: Any) -> RoleGroup:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        pg, share, members = self._slot(role)
        bundle_cpus = share.get("CPU", 1.0) * members
        n = self.workers_of[role]
        env_vars = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        remote_cls = ray.remote(RoleWorker)
        workers = [
            remote_cls.options(
                num_cpus=share.get("CPU", 0.0),
                num_gpus=share.get("GPU", 0.0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank, placement_group_capture_child_tasks=True
                ),
                runtime_env={"env_vars": env_vars} if env_vars else None,
                name=None,
            ).remote(role, rank, n)
            for rank in range(n)
        ]
        address, port = get(workers[0].free_address.remote())
        ips = get([w.node_ip.remote() for w in workers])
        seen: Counter[str] = Counter()
        setups = []
        for rank, (worker, ip) in enumerate(zip(workers, ips)):
            env = {"MASTER_ADDR": address, "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(n), "LOCAL_RANK": str(seen[ip])}
            seen[ip] += 1
            setups.append(worker.setup.remote(cls, args, kwargs, env, int(bundle_cpus)))
        get(setups)
        group = RoleGroup(role, cls, workers)
        self.groups[role] = group
        return group

    def describe(self) -> dict[str, str]:
        return {key: f"{len(b)} bundle(s) of {b[0]}" for key, (_, b) in self.layout.items()}

    def shutdown(self) -> None:
        ray = self._ray
        for group in self.groups.values():
            for worker in group.workers:
                try:
                    ray.get(worker.shutdown.remote(), timeout=30)
                except Exception:
                    pass
                ray.kill(worker)
        self.groups.clear()
        for pg in self.pgs.values():
            release(pg)
        self.pgs.clear()
        if self.started:
            ray.shutdown()
