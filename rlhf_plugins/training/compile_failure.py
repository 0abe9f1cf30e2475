"""A failure of torch.compile as one line a user can act on.

``--learner.compile`` writes its kernels into torch.compile's cache (``TORCHINDUCTOR_CACHE_DIR``, by
default a folder under the system's temporary directory) and trusts a kernel file once it exists: a run
killed while the C++ compiler was writing one leaves it half-written, and every later compile that
needs it fails -- torch reports a 600-line traceback ending in "file too short" or in C++ errors about
its own headers. The run stops instead with one line naming the role, what failed, the cache folder to
delete and the flag that runs without compiling (``-v`` shows the traceback); ``status.json`` records it.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

from ..errors import UsageError, causes, summary
from .out_of_memory import role_of

#: the exceptions torch raises when compiling failed (dynamo wraps the backend's; Ray's wrapper keeps the name)
_NAMES = ("BackendCompilerFailed", "InductorError", "CppCompileError")


class CompileFailed(UsageError):
    """torch.compile failed in a role; the message names the cache and the way to run without it."""

    exit_code = 1


def is_compile_failure(exc: BaseException) -> bool:
    return any(name in type(e).__name__ for e in causes(exc) for name in _NAMES)


def cache_folders() -> list[str]:
    """torch.compile's cache (``TORCHINDUCTOR_CACHE_DIR``, else torch's default for this user) and the
    folder of its precompiled C++ headers, which stays in the default whatever that variable says."""
    folders = []
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # torch < 2.5
        from torch._inductor.runtime.runtime_utils import cache_dir  # type: ignore[no-redef]
    try:
        folders.append(cache_dir())
    except OSError:
        default = os.path.join(tempfile.gettempdir(), "torchinductor_*")
        folders.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default)
    from torch._inductor import codecache

    headers = getattr(codecache, "_HEADER_DIR", None)
    if headers and os.path.isdir(headers) and not headers.startswith(folders[0] + os.sep):
        folders.append(headers)
    return folders


def what_failed(exc: BaseException) -> str:
    """The innermost compile error's first line; for a C++ compile error also the compiler's first error."""
    inner = [e for e in causes(exc) if any(name in type(e).__name__ for name in _NAMES)][-1]
    text, first = str(inner).strip(), summary(inner)
    found = next((line.split("error:", 1)[1].strip() for line in text.splitlines() if " error:" in line), None)
    return f"{first} ({found})" if found and "C++ compile error" in text else first


def explain(exc: BaseException, config: Any = None) -> CompileFailed:
    role = role_of(exc)
    where = f"in role '{role}' " if role else ""
    compiled = config is not None and getattr(getattr(config, "learner", None), "compile", False)
    without = "; or run without --learner.compile" if compiled else ""
    folders = cache_folders()
    them = "them" if len(folders) > 1 else "it"
    return CompileFailed(
        f"torch.compile failed {where}-- {what_failed(exc)}; if a run was killed while compiling, torch's cache "
        f"({' and '.join(folders)}) holds half-written files it trusts: delete {them} (or set TORCHINDUCTOR_CACHE_DIR "
        f"to a new folder) and run again{without} (-v shows the traceback)")
