"""Checkpoint folders: written atomically, verified on load, pruned to the newest ``K``.

A checkpoint is ``RUN_DIR/checkpoints/step-000050/`` holding what each role wrote (``actor/``,
``critic/``, the loop's ``trainer.json`` and ``trainer.pt``, ``plugins.json``) and, written last,
``manifest.json`` with every file's size and CRC-32. It is assembled in a hidden temporary
folder beside it and renamed into place only when complete, so a crash mid-write never leaves
something that looks like a checkpoint, and the previous one is never touched before the new one
exists. Multi-node runs need the run directory on storage every node sees (as for any shared
checkpoint).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .._version import __version__
from ..errors import UsageError

DIRNAME = "checkpoints"
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step-(\d+)$")


class CheckpointError(UsageError):
    """A checkpoint that is missing, incomplete or damaged, or cannot be written."""


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / DIRNAME / f"step-{step:06d}"


def checksum(path: Path) -> str:
    """CRC-32 of a file (zlib's, several GB/s): a check against torn and damaged files, not tampering."""
    crc = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _durable_digest(path: Path) -> str:
    """Flush a written file to disk and return its checksum."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
    return checksum(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write(run_dir: Path, step: int, fill: Callable[[Path], dict[str, Any]], keep: int, max_bytes: int = 0) -> Path:
    """Create the checkpoint of ``step``: ``fill(tmp_dir)`` writes the files (and returns extra
    manifest fields); then the manifest, then the rename. Older checkpoints beyond ``keep``, or beyond
    ``max_bytes`` on disk, go (:func:`prune`)."""
    root = run_dir / DIRNAME
    final = step_dir(run_dir, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        start = time.perf_counter()
        extra = fill(tmp) or {}
        paths = sorted(p for p in tmp.rglob("*") if p.is_file())
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:  # zlib frees the GIL on large blocks
            digests = list(pool.map(_durable_digest, paths))
        files = {str(path.relative_to(tmp)): {"bytes": path.stat().st_size, "crc32": digest}
                 for path, digest in zip(paths, digests)}
        manifest = {"step": step, "version": __version__, "created": time.time(), "files": files,
                    "write_seconds": time.perf_counter() - start, **extra}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync_dir(tmp)
        if final.exists():  # the same step again (an end-of-run checkpoint after a periodic one)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"cannot write the checkpoint of step {step} under '{root}': {exc.strerror or exc}; the previous "
            "checkpoint is intact (free space or fix permissions, then resume)"
        ) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(run_dir, keep, max_bytes)
    return final


def complete(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (with a manifest), oldest first."""
    root = run_dir / DIRNAME
    out = []
    if root.is_dir():
        for path in root.iterdir():
            m = _STEP.match(path.name)
            if m and (path / MANIFEST).is_file():
                out.append((int(m.group(1)), path))
    return sorted(out)


def prune(run_dir: Path, keep: int, max_bytes: int = 0) -> None:
    """Remove the oldest complete checkpoints: all but the newest ``keep`` (0: no count limit), then more
    while those left take over ``max_bytes`` on disk (0: no size limit); the newest always stays."""
    kept = [path for _, path in complete(run_dir)]
    if keep > 0:
        for path in kept[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
        kept = kept[-keep:]
    sizes = [sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) for path in kept] if max_bytes else []
    while max_bytes and len(kept) > 1 and sum(sizes) > max_bytes:
        shutil.rmtree(kept.pop(0), ignore_errors=True)
        sizes.pop(0)


def verify(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, after checking every file it lists."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"'{path}' is not a complete checkpoint (no {MANIFEST}); give a run directory or "
                              f"one of its {DIRNAME}/step-N folders")
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint '{path}' has an unreadable {MANIFEST}: {exc}") from exc
    for name, meta in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint '{path}' is damaged: '{name}' is missing")
        if file.stat().st_size != meta["bytes"] or checksum(file) != meta["crc32"]:
            raise CheckpointError(f"checkpoint '{path}' is damaged: '{name}' does not match its checksum; "
                                  "resume from an earlier checkpoint folder")
    return manifest


def find(target: Path) -> tuple[Path, Path]:
    """``--resume TARGET``: a run directory (its newest complete checkpoint) or a checkpoint folder.
    Returns (run directory, checkpoint folder)."""
    target = target.expanduser()
    if not target.exists():
        raise CheckpointError(f"--resume '{target}' does not exist; give a run directory or a checkpoint folder")
    if (target / MANIFEST).is_file() or _STEP.match(target.name):
        return target.parent.parent, target
    found = complete(target)
    if not found and not (target / "config.yaml").is_file() and not (target / DIRNAME).is_dir():
        from .runlog import runs_inside

        raise CheckpointError(f"--resume '{target}' is neither a run directory (config.yaml) nor a checkpoint "
                              f"folder{runs_inside(target)}; give one")
    if not found:
        raise CheckpointError(f"run directory '{target}' has no complete checkpoint to resume from "
                              f"(nothing under {target / DIRNAME}); it stopped before its first checkpoint")
    return target, found[-1][1]
