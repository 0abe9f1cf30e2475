"""Ray placement: one placement group per role (or per colocated set of roles),
N Ray actors per role forming a torch.distributed group, method calls dispatched
to them so the training loop cannot tell them from local objects."""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import RoleFailed, UsageError
from ..protocols import PlacementContext
from .ray_cluster import check_capacity, check_options, connect, release, reserve
from .ray_roles import NOSET_ENV, RoleGroup, RoleWorker, get

logger = logging.getLogger("rlhf_plugins")

#: how long the workers of a run that ends get, together, to stop before they are killed
SHUTDOWN_SECONDS = 10.0
#: how long a restart waits for the cluster to let go of the names of the workers it killed
NAME_RELEASE_SECONDS = 60.0
#: roles that share one placement group (and split each bundle's GPU and CPU) per mode
COLOCATE = {
    "none": (),
    "actor_ref": (("actor", "reference"),),
    "critic_reward": (("critic", "reward"),),
    "all": (("actor", "reference", "critic", "reward", "generation"),),
    # verl's hybrid engine: the policy's three roles in one process per rank, taking turns
    "hybrid": (("actor", "reference", "generation"),),
}
#: environment a worker inherits from the driver (local clusters would, remote ones do not)
FORWARDED_ENV = ("RLHF_CACHE_DIR", "RLHF_DISABLE_PLUGIN_AUTOLOAD", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                 "TOKENIZERS_PARALLELISM", "TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR", "PYTHONPATH", NOSET_ENV)


class RayPlacement:
    """``--placement.strategy ray``."""

    def __init__(self, ctx: PlacementContext) -> None:
        import ray

        self.opts = opts = ctx.config.section("ray")
        check_options(opts)
        begin = time.perf_counter()
        self.started = connect(opts)
        #: seconds spent starting: joining or starting the cluster, reserving, and each role
        self.startup: dict[str, float] = {"cluster": time.perf_counter() - begin}
        self._ray = ray
        if ctx.plugin_spec is not None:
            for module in ctx.plugin_spec.file_modules():  # not importable by name in workers
                ray.cloudpickle.register_pickle_by_value(module)
        self.workers_of = {
            "actor": opts.actor_workers,
            "critic": opts.critic_workers,
            "reference": opts.reference_workers,
            "generation": 1,
            "reward": opts.reward_workers,
            **ctx.workers,
        }
        self.accelerated = set(ctx.accelerated)
        self.roles = tuple(ctx.roles)
        self.layout = self._layout()
        self.groups: dict[str, RoleGroup] = {}
        self.specs: dict[str, tuple[type, tuple, dict]] = {}
        self.restarts = 0
        #: names this run's actors ``rlhf-<run id>-<role>-<rank>`` (for `ray list actors` and tests)
        self.run_id = uuid.uuid4().hex[:8]
        self.pgs: dict[str, Any] = {}
        #: every actor this placement made (shutdown kills them even if their role never came up)
        self.actors: list[Any] = []
        #: roles start concurrently (their actors import torch and load models side by side);
        #: ``ready()`` waits for all of them
        self._starting = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rlhf-role-start")
        #: --ray.colocate hybrid: the actors hosting several roles, by placement-group key
        self._hosted: dict[str, list[Any]] = {}
        self._hosting = threading.Lock()
        check_capacity({key: bundles for key, (_, bundles) in self.layout.items()})
        begin = time.perf_counter()
        for key, (_, bundles) in self.layout.items():
            self.pgs[key] = reserve(bundles, opts.strategy, opts.ready_timeout, name=f"rlhf-{key}")
        self.startup["placement groups"] = time.perf_counter() - begin

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
            gpu = o.gpus_per_worker if any(m in self.accelerated for m in members) else 0.0
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
        """The role's group at once; its actors start in the background (``ready()`` waits)."""
        self.specs[role] = (cls, args, kwargs)
        started: Future = self._starting.submit(self._timed_start, role, cls, args, kwargs)
        group = RoleGroup(role, cls, started, self.opts.call_timeout or None)
        self.groups[role] = group
        return group

    def ready(self) -> None:
        """Wait until every role created so far is constructed; the first failure is raised."""
        for group in self.groups.values():
            group.workers  # noqa: B018  (resolves the start, raising what it raised)

    def _timed_start(self, role: str, cls: type, args: tuple, kwargs: dict) -> list[Any]:
        begin = time.perf_counter()
        workers = self._start(role, cls, args, kwargs)
        self.startup[f"role {role}"] = time.perf_counter() - begin
        return workers

    def _host(self, role: str) -> str | None:
        """The placement-group key of the roles ``role`` shares its process with (``--ray.colocate hybrid``)."""
        if self.opts.colocate == "hybrid":
            for key, (members, _) in self.layout.items():
                if role in members and len(members) > 1:
                    return key
        return None

    def _spawn(self, name: str, pg: Any, resources: dict[str, float], n: int) -> list[Any]:
        """``n`` worker actors named after ``name``, one on each bundle of ``pg``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # a cluster this process started inherited our environment; only a joined one needs it passed
        # (a runtime env also keeps actors off the workers Ray pre-started, costing a process start)
        env_vars = {} if self.started else {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        remote_cls = self._ray.remote(RoleWorker)
        workers = [
            remote_cls.options(
                num_cpus=resources.get("CPU", 0.0),
                num_gpus=resources.get("GPU", 0.0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank, placement_group_capture_child_tasks=True
                ),
                runtime_env={"env_vars": env_vars} if env_vars else None,
                name=self.actor_name(name, rank),
            ).remote(name, rank, n)
            for rank in range(n)
        ]
        self.actors += workers
        return workers

    def actor_name(self, name: str, rank: int) -> str:
        """The Ray name of the worker of role (or host) ``name`` at ``rank``: ``rlhf-<run>-<name>-<rank>``."""
        return f"rlhf-{self.run_id}-{name}-{rank}"

    def await_released(self, names: list[str], timeout: float = NAME_RELEASE_SECONDS) -> None:
        """Wait until the cluster has let go of the names of killed workers: ``ray.kill`` returns before the
        cluster forgets an actor, and a new worker under a name still held fails to start."""
        deadline = time.monotonic() + timeout
        while held := sorted(set(names) & set(self._ray.util.list_named_actors())):
            if time.monotonic() > deadline:
                raise RoleFailed(f"Ray still holds the workers {', '.join(held)} {timeout:g} s after they were "
                                 "killed; the run cannot restart them under their names")
            time.sleep(0.05)

    def _start(self, role: str, cls: type, args: tuple, kwargs: dict) -> list[Any]:
        """The role's actors on its bundles, each with its rank's distributed environment. Roles
        hosted together construct their objects in the same actors (the first to start makes them)."""
        pg, share, members = self._slot(role)
        bundle_cpus = share.get("CPU", 1.0) * members
        n = self.workers_of[role]
        host = self._host(role)
        if host is None:
            workers = self._spawn(role, pg, share, n)
        else:
            with self._hosting:
                if host not in self._hosted:
                    self._hosted[host] = self._spawn(host, pg, {k: v * members for k, v in share.items()}, n)
                workers = self._hosted[host]
        # starting a role (its actors import torch and load a model) is bounded by the longer of the two
        # waits, so a short --ray.call_timeout for calls does not cut a slow start short
        timeout = max(self.opts.call_timeout, self.opts.ready_timeout) if self.opts.call_timeout else None
        address, port = get(workers[0].free_address.remote(), f"role '{role}' start", timeout)
        ips = get([w.node_ip.remote() for w in workers], f"role '{role}' start", timeout)
        seen: Counter[str] = Counter()
        setups = []
        for rank, (worker, ip) in enumerate(zip(workers, ips)):
            env = {"MASTER_ADDR": address, "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(n), "LOCAL_RANK": str(seen[ip])}
            seen[ip] += 1
            setups.append(worker.setup.remote(cls, args, kwargs, env, int(bundle_cpus), role))
        get(setups, f"role '{role}' start", timeout)
        return workers

    @property
    def max_restarts(self) -> int:
        return self.opts.max_restarts

    def recover(self) -> list[str]:
        """Restart every role with a dead (or unresponsive) worker -- all of its ranks, since the
        survivors' process group is broken -- keeping the same handles. Returns the restarted
        roles; the caller restores their state (checkpoint, weights)."""
        if self.restarts >= self.opts.max_restarts:
            raise RoleFailed(f"a role died and the restart budget is used up ({self.restarts} of "
                             f"--ray.max_restarts {self.opts.max_restarts})")
        self.restarts += 1
        dead = [role for role, group in self.groups.items() if not group.alive()]
        # roles hosted in one process went down together and come back together
        hosts = {self._host(role) for role in dead} - {None}
        restarted = [role for role in self.groups if role in dead or self._host(role) in hosts]
        for host in hosts:
            self._hosted.pop(host, None)
        names = set()
        for role in restarted:
            group = self.groups[role]
            logger.warning("role '%s' lost a worker; restarting its %d rank(s) (restart %d of %d)", role,
                           len(group.workers), self.restarts, self.opts.max_restarts)
            for worker in group.workers:
                self._ray.kill(worker, no_restart=True)
            names |= {self.actor_name(self._host(role) or role, r) for r in range(len(group.workers))}
        self.await_released(sorted(names))  # every killed worker gone (a host's once) before any starts again
        for role in restarted:
            cls, args, kwargs = self.specs[role]
            self.groups[role].workers = self._start(role, cls, args, kwargs)
        return restarted

    def describe(self) -> dict[str, str]:
        return {key: f"{len(b)} bundle(s) of {b[0]}" for key, (_, b) in self.layout.items()}

    def shutdown(self) -> None:
        ray = self._ray
        self._starting.shutdown(wait=True)
        # every worker is asked to stop at once (closing engines, process groups, shared buffers), with
        # one deadline for all; a worker still inside a call that timed out could not answer, so it
        # is not asked. Then all are killed.
        hung = {w for group in self.groups.values() if group.hung for w in group.workers}
        stopping = [worker.shutdown.remote() for worker in self.actors if worker not in hung]
        if stopping:
            ray.wait(stopping, num_returns=len(stopping), timeout=SHUTDOWN_SECONDS, fetch_local=False)
        for worker in self.actors:
            ray.kill(worker)
        self.actors.clear()
        self.groups.clear()
        for pg in self.pgs.values():
            release(pg)
        self.pgs.clear()
        if self.started:
            ray.shutdown()
