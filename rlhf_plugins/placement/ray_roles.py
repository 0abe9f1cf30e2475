"""The Ray side of a role: the actor behind each rank (:class:`RoleWorker`), one rank as an
endpoint, and a group of ranks that dispatches the role's methods as they are marked. Every wait
is bounded by ``--ray.call_timeout`` and names the role, rank and method; a dead actor surfaces
as :class:`~rlhf_plugins.errors.RoleFailed`, which the loop answers by restarting it."""
from __future__ import annotations

import inspect
import os
import re
import sys
import time
from concurrent.futures import Future
from typing import Any

from ..dispatch import balance, dispatch_mode, merge_results, merge_samples, shard_batch, share_arguments
from ..errors import RoleCallTimeout, RoleFailed, UsageError

#: environment a worker inherits from the driver (local clusters would, remote ones do not)
NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def _dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


class RoleWorker:
    """The Ray actor behind one rank of a role: sets the distributed environment,
    constructs the role object, and runs its methods. Under ``--ray.colocate hybrid`` one worker
    hosts the objects of several roles (keyed by role; a call names the role it is for)."""

    def __init__(self, role: str, rank: int, world_size: int) -> None:
        self.role, self.rank, self.world_size = role, rank, world_size
        self.objs: dict[str, Any] = {}

    @property
    def obj(self) -> Any:
        """The object of the role this worker was made for (the first one set up on it)."""
        return next(iter(self.objs.values()), None)

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_address(self) -> tuple[str, int]:
        """This node's IP and a free port: rank 0's address for the role's process group."""
        from ..sync.groups import free_address

        return free_address()

    def setup(self, cls: type, args: tuple, kwargs: dict, env: dict[str, str], threads: int = 1,
              role: str | None = None) -> bool:
        import ray

        from ..training.host_memory import claim_process

        claim_process()  # a role actor's process is ours
        gpu_ids = ray.get_gpu_ids()
        if gpu_ids:
            # one visible GPU per actor, unless Ray was told not to touch *_VISIBLE_DEVICES
            env["LOCAL_RANK"] = str(int(gpu_ids[0])) if os.environ.get(NOSET_ENV) else "0"
        os.environ.update(env)
        # colocated roles take turns on their bundle, so each may use all of its CPUs. A role without a
        # GPU (rule rewards) need not import torch at all: torch takes the thread count from the
        # environment if something in the role imports it later
        threads = max(1, threads)
        if gpu_ids or "torch" in sys.modules:
            import torch

            torch.set_num_threads(threads)
            if not torch.cuda.is_available():
                os.environ.setdefault("DS_ACCELERATOR", "cpu")
        else:
            os.environ["OMP_NUM_THREADS"] = str(threads)
            if not os.environ.get(NOSET_ENV):  # Ray hid every GPU from an actor that holds none
                os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.objs[role or self.role] = cls(*args, **kwargs)
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
            "dist_initialized": "torch" in sys.modules and _dist_initialized(),
            "torch_imported": "torch" in sys.modules,
        }

    def call(self, method: str, args: tuple, kwargs: dict, role: str | None = None) -> Any:
        out = getattr(self.objs[role] if role else self.obj, method)(*args, **kwargs)
        if inspect.isgenerator(out):
            out = list(out)
        return out

    def call_function(self, fn: Any, args: tuple, role: str | None = None) -> Any:
        return (self.objs[role] if role else self.obj).call_function(fn, args)

    def call_with(self, fn: Any, roles: tuple[str, ...]) -> Any:
        """``fn(*objects of roles)`` here, where those roles' objects live side by side."""
        return fn(*(self.objs[r] for r in roles))

    def shutdown(self) -> None:
        for obj in self.objs.values():
            stop = getattr(obj, "shutdown", None)
            if callable(stop):
                stop()


def _died(exc: BaseException) -> bool:
    import ray

    return isinstance(exc, ray.exceptions.RayActorError) or isinstance(getattr(exc, "cause", None),
                                                                       ray.exceptions.RayActorError)


def get(refs: Any, what: str = "", timeout: float | None = None) -> Any:
    """``ray.get`` for role calls: a user error from a worker is re-raised as itself (one line for
    the CLI); a dead actor (here or in a call the worker made) is :class:`RoleFailed`; a call that
    does not return within ``timeout`` names ``what`` (role, rank, method). Waits for the first
    result in turn, so one failed rank is seen even while the others hang in a collective."""
    import ray

    single = not isinstance(refs, list)
    pending = [refs] if single else list(refs)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                raise RoleCallTimeout(f"{what or 'a role call'} did not return within {timeout:g} s "
                                      "(--ray.call_timeout); the run stops instead of hanging")
            ray.get(ready[0])
        return ray.get(refs)
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as exc:
        _out_of_memory(exc, what)
        if not isinstance(exc, ray.exceptions.RayTaskError):
            raise RoleFailed(f"{what}: its process died ({type(exc).__name__})") from exc
        if _died(exc):
            raise RoleFailed(f"{what}: a process it called has died ({type(exc.cause).__name__})") from exc
        cause = getattr(exc, "cause", None)
        if isinstance(cause, UsageError):
            raise cause from None
        if getattr(exc, "role", None) is None:
            exc.role = _role_in(what)  # the one-line errors name it (out_of_memory.role_of)
        raise


def _role_in(what: str) -> str | None:
    """The role a call's description names (``role 'actor' rank 0``), if any."""
    found = re.search(r"role '([^']+)'", what)
    return found.group(1) if found else None


def _out_of_memory(exc: BaseException, what: str) -> None:
    """A role killed by Ray's memory monitor (or whose call ran out of memory) is not a fault a restart
    cures: raise :class:`OutOfMemory` naming the role instead of Ray's report."""
    from ..training.out_of_memory import OutOfMemory, is_out_of_memory

    if is_out_of_memory(exc):
        raise OutOfMemory(f"{what}: out of memory", _role_in(what)) from exc


class RayEndpoint:
    """One rank, addressable from any process (it pickles as its actor handle)."""

    def __init__(self, handle: Any, what: str = "", timeout: float | None = None, role: str | None = None) -> None:
        self.handle, self.what, self.timeout, self.role = handle, what, timeout, role

    def submit(self, fn: Any, *args: Any) -> Any:
        return self.handle.call_function.remote(fn, args, self.role)

    def call(self, fn: Any, *args: Any) -> Any:
        return get(self.submit(fn, *args), f"{self.what} running {getattr(fn, '__name__', fn)}", self.timeout)

    def wait(self, handles: list[Any]) -> list[Any]:
        return get(handles, f"{self.what} (weight sync)", self.timeout)


class RoleGroup:
    """N workers of one role; methods dispatch as the role class declares (:mod:`rlhf_plugins.dispatch`).
    The object outlives its workers: a restart replaces ``workers`` in place. ``workers`` may be
    given as a future of the list (the role still starting); the first use waits for it."""

    def __init__(self, role: str, cls: type, workers: Any, timeout: float | None = None) -> None:
        self.role, self.cls, self.timeout = role, cls, timeout
        self._workers = workers
        #: a call of this group's did not return in time: its workers are busy in it, so shutting
        #: the run down kills them without asking them to stop first
        self.hung = False

    @property
    def workers(self) -> list[Any]:
        if isinstance(self._workers, Future):
            self._workers = self._workers.result()
        return self._workers

    @workers.setter
    def workers(self, workers: list[Any]) -> None:
        self._workers = workers

    def _get(self, refs: Any, method: str, rank: int | None = None) -> Any:
        if rank is None and len(self.workers) == 1:
            rank = 0
        ranks = f"rank {rank}" if rank is not None else f"{len(self.workers)} ranks"
        try:
            return get(refs, f"role '{self.role}' ({ranks}) in '{method}'", self.timeout)
        except RoleCallTimeout:
            self.hung = True
            raise

    def run(self, fn: Any, *args: Any, rank: int | None = None) -> Any:
        name = getattr(fn, "__name__", str(fn))
        if rank is not None:
            return self._get(self.workers[rank].call_function.remote(fn, args, self.role), name, rank)
        return self._get([w.call_function.remote(fn, args, self.role) for w in self.workers], name)

    def run_with(self, other: RoleGroup, fn: Any) -> Any:
        """``fn(this role's object, other's)`` in the process that hosts both (``--ray.colocate
        hybrid``: one rank each, one actor); a plain pair of groups has no such process."""
        if len(self.workers) != 1 or self.workers != other.workers:
            raise UsageError(f"roles '{self.role}' and '{other.role}' are not hosted in one process")
        return self._get(self.workers[0].call_with.remote(fn, (self.role, other.role)),
                         getattr(fn, "__name__", str(fn)), 0)

    def hosted_with(self, other: Any) -> bool:
        """Whether ``other`` is a group whose one rank is this group's one actor."""
        return isinstance(other, RoleGroup) and len(self.workers) == 1 and self.workers == other.workers

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not hasattr(self.cls, name):
            raise AttributeError(name)
        mode = dispatch_mode(self.cls, name)

        def remote_method(*args: Any, **kwargs: Any) -> Any:
            return self._dispatch(name, mode, args, kwargs)

        return remote_method

    def _dispatch(self, name: str, mode: str, args: tuple, kwargs: dict) -> Any:
        if mode == "one" or len(self.workers) == 1 and mode != "split":
            return self._get(self.workers[0].call.remote(name, args, kwargs, self.role), name, 0)
        if mode == "all":
            return self._get([w.call.remote(name, args, kwargs, self.role) for w in self.workers], name)[0]
        if mode == "prompts":
            return self._generate_balanced(name, args, kwargs)
        batch, rest = args[0], args[1:]
        shards = shard_batch(batch, len(self.workers), objective=rest[0] if rest else None)
        refs = [w.call.remote(name, (shard, *rest), kwargs, self.role) for w, shard in zip(self.workers, shards)]
        return merge_results(self._get(refs, name))

    def _generate_balanced(self, name: str, args: tuple, kwargs: dict) -> Any:
        """Prompts to engines by load (prompt tokens), results back in prompt order."""
        prompts, rest = args[0], args[1:]
        shares = balance([len(p) for p in prompts], len(self.workers))
        busy = [(w, idx) for w, idx in zip(self.workers, shares) if idx]
        calls = [share_arguments(([prompts[i] for i in idx], *rest), kwargs, k) for k, (_, idx) in enumerate(busy)]
        parts = self._get([w.call.remote(name, *call, self.role) for (w, _), call in zip(busy, calls)], name)
        return merge_samples([idx for _, idx in busy], parts)

    def endpoints(self) -> list[RayEndpoint]:
        return [RayEndpoint(w, f"role '{self.role}' rank {r}", self.timeout, self.role)
                for r, w in enumerate(self.workers)]

    def env_info(self) -> list[dict[str, Any]]:
        return self._get([w.env_info.remote() for w in self.workers], "env_info")

    def alive(self, timeout: float = 10.0) -> bool:
        """Whether every worker answers (a dead actor fails at once, a hung one by ``timeout``)."""
        import ray

        refs = [w.node_ip.remote() for w in self.workers]
        try:
            ray.get(refs, timeout=timeout)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False
