"""Host memory of a process that holds models: keep what large tensors free for the next ones.

glibc's malloc serves every allocation above its mmap threshold (at most 32 MB) with a fresh
``mmap`` and gives it back with ``munmap`` when the tensor is freed, and it returns the top of
the heap to the system once more than its trim threshold is free. A training step on the CPU
allocates and frees activations of tens of MB many times over, so each one is faulted in page by
page and zeroed by the kernel again: at the realistic benchmark's shape (64 x 250 tokens, hidden
512) that was about a fifth of a training step. ``--train.reuse_freed_memory`` (on by default)
makes glibc serve every allocation from its heap and never trim it, so freed activations are
reused as they are. The cost: the process keeps its peak memory resident until it exits. It is on
by default only in processes this project owns -- the ``rlhf`` command and Ray role actors -- never
in a program that calls ``rlhf_plugins.api.train`` unless that program asks for it.

Other C libraries (macOS, musl) are left alone, and so is a process that already tuned malloc
through its environment (``MALLOC_MMAP_MAX_``, ``MALLOC_TRIM_THRESHOLD_``, ... or ``glibc.malloc.*`` in
``GLIBC_TUNABLES``).
"""
from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("rlhf_plugins")

#: mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
#: allocations from this size are mapped on their own and unmapped when freed (release_freed_memory)
RELEASE_THRESHOLD = 1 << 20
#: the largest trim threshold mallopt takes (an int): never trim in practice
NEVER_TRIM = 2**31 - 1
#: glibc's own defaults, restored while memory must go back to the system
DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD = 65536, 128 * 1024
#: environment through which a user tuned glibc's malloc themselves (and GLIBC_TUNABLES' malloc part)
USER_TUNING = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

_applied: bool | None = None
_released = False


def glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (the one with ``mallopt``), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        return libc if hasattr(libc, "mallopt") else None
    except (OSError, AttributeError):
        return None


def user_tuned() -> bool:
    """Whether the user tuned glibc's malloc through the environment (then it is left alone)."""
    return any(k in os.environ for k in USER_TUNING) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")


def reuse_freed_memory() -> bool:
    """Serve allocations from the heap and never trim it (once per process). Returns whether
    this process now does; False on a C library other than glibc or under the user's own tuning."""
    global _applied
    if _applied is not None or _released:
        return bool(_applied)
    libc = glibc()
    if libc is None:
        logger.debug("reuse_freed_memory: not glibc; malloc left as it is")
        _applied = False
    elif user_tuned():
        logger.debug("reuse_freed_memory: malloc tuned through the environment; left as it is")
        _applied = False
    else:
        _applied = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
    return _applied


def release_freed_memory() -> bool:
    """Map every allocation of 1 MB or more on its own and unmap it when freed (once per process):
    a freed tensor's memory goes back to the system at once. glibc otherwise raises its mmap threshold
    to the size of blocks freed earlier (up to 32 MB) and serves them from a heap that fragments: a
    ZeRO-3 rank of a 0.5B model kept 2.5 GB it was not using, its peak 8.2 GB where 6.0 was live.
    Returns whether this process now does (not on other C libraries, nor under the user's own tuning,
    nor once reuse_freed_memory applied)."""
    global _released
    if _applied is not None or _released:
        return _released
    libc = glibc()
    if libc is None or user_tuned():
        return False
    _released = bool(libc.mallopt(M_MMAP_THRESHOLD, RELEASE_THRESHOLD))  # fixed: no longer raised by frees
    return _released


@contextmanager
def returned_to_the_system() -> Iterator[None]:
    """Within: glibc's defaults (large blocks mapped and unmapped, the heap trimmed), after handing
    back what the process had freed. For code that sizes itself from this process's resident memory
    -- vLLM on the CPU gives its KV cache the configured share of the node minus this process's RSS,
    so memory kept for reuse (and temporaries of loading its model) would come out of the cache."""
    libc = glibc() if _applied else None
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
    libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
    libc.malloc_trim(0)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_MAX, 0)
        libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)


#: whether this process is one rlhf-plugins owns (the ``rlhf`` command, a Ray role actor)
_owned = False


def claim_process() -> None:
    """Mark this process as one rlhf-plugins owns: process-wide settings may apply by default."""
    global _owned
    _owned = True


def apply(config: object) -> None:
    """The process-wide memory setting of a role's process (``train.reuse_freed_memory``). Empty: in
    processes this project owns, reuse for the small models it speeds up, release for a real model
    (:data:`~rlhf_plugins.config.scale.REAL_MODEL_PARAMETERS` and up), whose memory matters more than
    page faults; nothing in a process that is not ours."""
    wanted = getattr(getattr(config, "train", None), "reuse_freed_memory", None)
    if wanted:
        reuse_freed_memory()
    elif wanted is None and _owned:
        if _real_model(config):
            release_freed_memory()
        else:
            reuse_freed_memory()


def _real_model(config: object) -> bool:
    path = getattr(getattr(config, "model", None), "path", None)
    if not path:
        return False
    from ..config.scale import REAL_MODEL_PARAMETERS
    from ..models.memory import ModelShape

    return ModelShape.of_folder(path).parameters >= REAL_MODEL_PARAMETERS
