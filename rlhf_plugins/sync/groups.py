"""A process group for weight sync that lives beside any training group.

Built directly on a TCPStore (gloo on CPU, NCCL on GPU), so it can span the
learner's rank 0 and generation-engine processes that belong to no common
``torch.distributed`` world.
"""
from __future__ import annotations

import datetime
import random
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where a group is made: free_address also serves role actors (a rule-reward role
# never imports torch)


def free_address() -> tuple[str, int]:
    """This node's IP and a free TCP port (for rank 0 of a new group)."""
    try:
        import ray

        host = ray.util.get_node_ip_address()
    except Exception:
        host = "127.0.0.1"
    return host, free_port()


#: the lowest port chosen (Ray's worker ports end at 19999)
LOWEST_PORT = 20000


def free_port(tries: int = 64) -> int:
    """A free TCP port below the kernel's ephemeral range where there is room (Linux: 20000-32767).
    Rank 0 binds the port seconds after it is chosen (its peers import torch and load a model first);
    a port from the ephemeral range may meanwhile be handed to any outgoing connection on the node --
    Ray's own make many -- and the group's start would fail with EADDRINUSE. Below that range only an
    explicit bind can take it. Without room, or when none is free, a port the kernel picks."""
    rng = random.Random()  # seeded from the OS: not the run's seeded generators
    high = _ephemeral_start() - 1
    for _ in range(tries if high - LOWEST_PORT >= tries else 0):
        port = rng.randint(LOWEST_PORT, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's file; 32768, its default, elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


class SyncGroup:
    def __init__(self, address: str, port: int, world_size: int, rank: int, backend: str,
                 timeout_s: float = 300) -> None:
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(address, port, world_size, rank == 0, timeout=timeout)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        if backend == "nccl":  # pragma: no cover - GPU branch
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
            self.device = torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()
