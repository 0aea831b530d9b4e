"""Atomic checkpoints: write a temporary file, fsync, rename; keep the last K.

A kill at any moment leaves either the previous checkpoint or the new one, never a torn file,
because ``os.replace`` within one directory is atomic. Files are named ``step-00000120.pt`` so the
newest is found by name; everything in them loads with ``torch.load(weights_only=True)``
(tensors, numbers, strings, lists and dicts only).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import PhalanxError

_NAME = re.compile(r"^step-(\d+)\.pt$")


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.pt"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in ``directory``, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def ensure_writable(directory: str | os.PathLike) -> Path:
    """Create ``directory`` if needed and prove a file can be written there (then remove it)."""
    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".phalanx-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PhalanxError(
            f"cannot write checkpoints to {root}: {e.strerror or e}; choose another --checkpoint-dir"
        ) from None
    return root


def to_cpu(obj: Any) -> Any:
    """A copy of nested dicts/lists/tuples with every tensor on the CPU (checkpoints load anywhere)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete half-written checkpoints that a killed run left behind (never a finished one)."""
    root = Path(directory)
    stale = [p for p in root.glob(".step-*.pt.*.tmp")] if root.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def save_checkpoint(state: dict[str, Any], directory: str | os.PathLike, step: int, keep: int) -> Path:
    """Write ``state`` atomically as the checkpoint of ``step``; prune to the newest ``keep``."""
    root = Path(directory)
    final = checkpoint_path(root, step)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=root)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(to_cpu(state), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint safely; a missing, corrupt or foreign file is a clear error."""
    p = Path(path)
    if p.is_dir():
        found = latest_checkpoint(p)
        if found is None:
            raise PhalanxError(f"no checkpoint (step-*.pt) in {p}; train first, or pass a checkpoint file to --resume")
        p = found
    if not p.is_file():
        raise PhalanxError(f"checkpoint {p} does not exist; pass an existing file or directory to --resume")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PhalanxError(
            f"checkpoint {p} is corrupt or not a phalanx checkpoint ({first[:120]}); "
            "resume from an earlier step-*.pt in the same directory"
        ) from None
    if not isinstance(state, dict) or state.get("format") != "phalanx-checkpoint-1":
        raise PhalanxError(f"{p} is not a phalanx checkpoint; pass a step-*.pt written by phalanx train")
    state["path"] = str(p)
    return state
