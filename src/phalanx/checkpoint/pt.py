"""A single-file checkpoint, ``step-00000120.pt``: written atomically, read without running anything.

- **Atomic.** Written to a temporary file, fsynced, renamed: ``os.replace`` within one directory is atomic,
  so a kill at any moment leaves the previous checkpoint or the new one, never a torn file.
- **Checksummed** (``integrity.py``): its payload's SHA-256 is in it, recomputed on every read.
- **Read** with ``torch.load(weights_only=True)``: tensors, numbers, strings, lists, dicts; nothing it names
  is run.

A sharded checkpoint's own state file (``dcp.py``) is one of these, written and read the same way.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..data.batch import to_cpu
from ..errors import PhalanxError
from .directory import commit
from .format import FORMAT, checkpoint_path
from .integrity import payload_digest


def save_checkpoint(state: dict[str, Any], directory: str | os.PathLike, step: int, keep: int) -> Path:
    """Write ``state`` (plus its checksum) atomically as the checkpoint of ``step``; keep the ``keep``
    written last. The run record names the file before it exists (a name without a file is skipped
    by every reader), so a kill between the two never leaves a checkpoint the record does not know."""
    payload = to_cpu(state)
    payload["checksum"] = payload_digest(payload)
    return commit(directory, checkpoint_path(directory, step), str(state.get("run_id") or ""), keep,
                  lambda final: write_file(payload, final))


def write_file(payload: dict[str, Any], final: Path) -> None:
    """``payload`` as ``final``, atomically: a temporary file beside it, fsynced, renamed (removed on failure)."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read(p: Path, use: str = "--resume") -> dict[str, Any]:
    """Load and verify one file; PhalanxError naming what is wrong with it (and what to give ``use`` instead)."""
    earlier = "resume from an earlier step-*.pt in the same directory" if use == "--resume" else \
        f"give {use} an earlier step-*.pt of the same directory"
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if first.startswith("Weights only load failed"):
            first = "it holds objects a checkpoint never holds"
        raise PhalanxError(f"checkpoint {p} is corrupt or not a phalanx checkpoint ({first[:120]}); {earlier}"
                           ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise PhalanxError(f"{p} is not a phalanx checkpoint; pass a step-*.pt written by phalanx train")
    expected = state.get("checksum")
    if expected is not None and payload_digest(state) != expected:
        raise PhalanxError(f"checkpoint {p} is corrupt (its checksum does not match: the file changed after it "
                           f"was written); {earlier}")
    state["path"] = str(p)
    return state
