"""Connecting to Ray and reserving placement groups, with bounded waits and
messages that say what was asked and what the cluster has."""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from ..errors import UsageError

logger = logging.getLogger("rlhf_plugins")


class ClusterError(UsageError):
    """The Ray cluster cannot be reached or cannot hold the requested placement."""


def _host_port(address: str) -> tuple[str, int] | None:
    addr = address.removeprefix("ray://")
    if ":" not in addr:
        return None
    host, _, port = addr.rpartition(":")
    try:
        return host, int(port)
    except ValueError:
        return None


#: Ray picks a network-reachable node address unless this is off (its default on macOS and Windows);
#: a cluster this run starts for itself only ever talks to this machine, so it listens on loopback
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def loopback_only() -> None:
    """Make the local cluster this process starts bind 127.0.0.1, not the machine's address."""
    import sys

    os.environ[LOOPBACK_ENV] = "0"  # read when ray is imported, here and in the processes it starts
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray was imported before: its constant is already read
        constants.ENABLE_RAY_CLUSTER = False


def connect(opts: Any) -> bool:
    """Join the cluster named by ``ray.address`` / ``RAY_ADDRESS`` (or the one this job runs
    in), else start a local one, listening on 127.0.0.1. Returns whether this process started it."""
    address = opts.address or os.environ.get("RAY_ADDRESS")
    local = not address or address == "local"
    import sys

    if local and not (sys.modules.get("ray") is not None and sys.modules["ray"].is_initialized()):
        loopback_only()
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address and address != "local":
        target = _host_port(address)
        if target is None and address != "auto":
            raise ClusterError(f"ray.address '{address}' is not an address; give HOST:PORT (e.g. 127.0.0.1:6379), "
                               "ray://HOST:PORT, auto, or leave it empty to start a local cluster")
        if target is not None:
            try:
                socket.create_connection(target, timeout=opts.connect_timeout).close()
            except OSError as exc:
                raise ClusterError(
                    f"cannot reach the Ray cluster at '{address}' within {opts.connect_timeout:g} s ({exc}); "
                    "check --ray.address or RAY_ADDRESS, or omit both to start a local cluster"
                ) from exc
            _speaks_grpc(address, target, opts.connect_timeout)
        ray.init(address=address, log_to_driver=opts.log_to_driver, logging_level=logging.ERROR)
        return False
    num_cpus = opts.local_num_cpus or max(8, os.cpu_count() or 1)
    # "local": a new cluster of our own -- without it Ray joins whatever cluster another process of this
    # machine last started (its /tmp/ray/ray_current_cluster), and refuses the resources asked for
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        num_cpus=num_cpus,
        num_gpus=opts.local_num_gpus,
        include_dashboard=False,
        log_to_driver=opts.log_to_driver,
        logging_level=logging.ERROR,
    )
    return True


def _speaks_grpc(address: str, target: tuple[str, int], timeout: float) -> None:
    """A Ray head answers gRPC (HTTP/2); some other service on the port would leave ``ray.init``
    retrying for minutes, so say so now."""
    import grpc

    channel = grpc.insecure_channel(f"{target[0]}:{target[1]}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        raise ClusterError(f"'{address}' answers, but not as a Ray cluster (no gRPC within {timeout:g} s); check "
                           "--ray.address (a Ray head's GCS port, 6379 by default)") from None
    finally:
        channel.close()


def describe_cluster() -> str:
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    total = ray.cluster_resources()
    per_node = "; ".join(
        f"node {i}: {_res(n.get('Resources', {}))}" for i, n in enumerate(nodes)
    )
    return f"{len(nodes)} node(s), {_res(total)} in all ({per_node})"


def _res(res: dict[str, float]) -> str:
    keys = [k for k in ("GPU", "CPU") if k in res]
    return ", ".join(f"{res[k]:g} {k}" for k in keys) or "no CPU/GPU"


def check_capacity(layout: dict[str, list[dict[str, float]]]) -> None:
    """All placement groups together must fit in the cluster (busy resources are waited for)."""
    import ray

    free = ray.cluster_resources()
    for key in ("GPU", "CPU"):
        parts = {name: sum(b.get(key, 0) for b in bundles) for name, bundles in layout.items()}
        need = sum(parts.values())
        if need > free.get(key, 0) + 1e-9:
            detail = ", ".join(f"{name} {v:g}" for name, v in parts.items() if v)
            hint = "lower ray.*_workers or colocate roles (--ray.colocate)"
            if key == "GPU" and not free.get("GPU"):
                hint = ("this cluster has no GPUs: run on CPUs with --ray.gpus_per_worker 0, or give a local cluster "
                        "fake GPUs with --ray.local_num_gpus N")
            raise ClusterError(
                f"the roles ask for {need:g} {key} in all ({detail}) but the cluster has {free.get(key, 0):g}: "
                f"{describe_cluster()}; {hint}"
            )


def reserve(bundles: list[dict[str, float]], strategy: str, timeout: float, name: str) -> Any:
    """A ready placement group, or a ClusterError that explains why not."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy=strategy, name=name)
    start = time.monotonic()
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(pg)
        hint = " (STRICT_SPREAD needs one node per bundle)" if strategy == "STRICT_SPREAD" else ""
        raise ClusterError(
            f"placement '{name}' ({len(bundles)} bundle(s) of {_res(bundles[0])}, {strategy}){hint} was not "
            f"ready after {time.monotonic() - start:.0f} s: {describe_cluster()}"
        )
    return pg


def release(pg: Any, timeout: float = 10.0) -> None:
    """Remove a placement group and wait until the cluster has taken its resources back."""
    import ray
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(pg)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray.util.placement_group_table(pg).get("state") == "REMOVED":
            return
        time.sleep(0.05)


def check_options(opts: Any) -> None:
    """The ``ray`` section within its declared bounds (validation does it too; a placement built
    directly, as in tests, checks here)."""
    from ..settings import check_bounds

    check_bounds(opts, "ray.")
