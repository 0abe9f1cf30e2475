"""Methods vLLM mixes into each of its workers (``worker_extension_cls``).

They run inside the worker that owns the model shard, so weights arrive where
they are used: by broadcast over the sync group, by IPC handle, or as tensors
when the worker shares the caller's process. Received buckets are held until
``rlhf_commit_weights`` loads them all at once. Arguments are plain values
(vLLM may serialise them to reach the worker).
"""
from __future__ import annotations

from typing import Any


class WorkerExtension:
    def rlhf_init_sync(self, address: str, port: int, world_size: int, rank_offset: int, backend: str) -> int:
        from ..sync.groups import SyncGroup

        rank = rank_offset + int(getattr(self, "rank", 0))
        self._rlhf_sync = SyncGroup(address, port, world_size, rank, backend)
        return rank

    def rlhf_receive_bucket(self, dtype: str, names: list[str], shapes: list[list[int]], numel: int) -> int:
        from ..sync.broadcast import Bucket, receive_bucket

        bucket = Bucket(dtype, list(names), [tuple(s) for s in shapes], numel)
        flat = receive_bucket(self._rlhf_sync, bucket)
        self._pending().extend(bucket.unpack(flat))
        return len(names)

    def rlhf_receive_ipc(self, dtype: str, names: list[str], shapes: list[list[int]], numel: int, handle: bytes,
                         index: int) -> int:
        from ..sync.broadcast import Bucket
        from ..sync.ipc import open_handle

        opened = self.__dict__.setdefault("_rlhf_ipc", {})
        if index not in opened or opened[index][0] != handle:
            opened[index] = (handle, open_handle(handle))  # kept open: closing the last mapping frees it
        flat = opened[index][1]
        bucket = Bucket(dtype, list(names), [tuple(s) for s in shapes], numel)
        self._pending().extend(bucket.unpack(flat))
        return len(names)

    def _pending(self) -> list[tuple[str, Any]]:
        return self.__dict__.setdefault("_rlhf_pending", [])

    def rlhf_commit_weights(self) -> int:
        """Load everything received since the last commit in one in-place reload: vLLM processes
        weights layer by layer (fusing, repacking), which needs each layer's tensors together."""
        pending = self._pending()
        if pending:
            self.reload_weights(weights_iterator=iter(pending))
        count = len(pending)
        pending.clear()
        return count

    def rlhf_load_weights(self, named: list[tuple[str, Any]]) -> int:
        """In-process only: tensors passed as they are."""
        self.reload_weights(weights_iterator=iter(named))
        return len(named)
