"""A process group for weight sync that lives beside any training group.

Built directly on a TCPStore (gloo on CPU, NCCL on GPU), so it can span the
learner's rank 0 and generation-engine processes that belong to no common
``torch.distributed`` world.
"""
from __future__ import annotations

import datetime
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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


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
