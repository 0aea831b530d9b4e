"""What a checkpoint is on disk, and how a run's directory lists its checkpoints.

A checkpoint is a file, ``step-00000120.pt`` (``pt.py``), or a sharded one's directory, ``step-00000120.dcp/``
(``dcp.py``), named by its step. The directory's run record, ``.phalanx-run.json``, names the run it belongs
to and its checkpoints in the order they were written: the newest is the one written last, which after a
resume from an earlier step is not the highest step. Everything here takes both kinds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import NamedTuple, Optional

from ..errors import PhalanxError
from ..files import replace_private

FORMAT = "phalanx-checkpoint-1"
#: a sharded checkpoint's own small state: written last, so a directory that has it is complete
STATE = "phalanx.pt"
LOCK_NAME = ".phalanx.lock"
RUN_NAME = ".phalanx-run.json"
_NAME = re.compile(r"^step-(\d+)\.(pt|dcp)$")


def checkpoint_path(directory: str | os.PathLike, step: int, sharded: bool = False) -> Path:
    return Path(directory) / f"step-{step:08d}.{'dcp' if sharded else 'pt'}"


def step_of(path: str | os.PathLike) -> Optional[int]:
    """The step a checkpoint's name says (``step-00000120.pt``: 120); None for a name phalanx does not give."""
    name = _NAME.match(Path(path).name)
    return int(name.group(1)) if name else None


def is_checkpoint(p: Path) -> bool:
    """A finished checkpoint: a file, or a sharded one's directory (it has its state file only once renamed)."""
    return p.is_file() or (p.suffix == ".dcp" and (p / STATE).is_file())


def is_damaged_checkpoint(p: Path) -> bool:
    """A sharded checkpoint's directory without its state file: renamed only once complete, so one damaged
    since (its ``phalanx.pt`` lost); read, it is refused as incomplete, and a directory read falls back."""
    return p.suffix == ".dcp" and p.is_dir() and not (p / STATE).is_file()


def remove(p: Path) -> None:
    """Delete a checkpoint, a file or a sharded one's directory."""
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def step_entries(directory: str | os.PathLike) -> list[Path]:
    """Everything in ``directory`` named like a checkpoint (files or not), in step order."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if (step := step_of(p)) is not None]
    return [p for _, p in sorted(found)]


class RunRecord(NamedTuple):
    """What ``.phalanx-run.json`` says: whose directory this is, and its checkpoints in write order."""

    run_id: str
    launcher: str  #: the torchrun job that last wrote here ("" when phalanx started the workers)
    checkpoints: tuple[str, ...]  #: file names, oldest written first (some may since be gone)


def read_run(directory: str | os.PathLike) -> Optional[RunRecord]:
    """The directory's run record; None when it has none (new, or written before records existed)."""
    path = Path(directory) / RUN_NAME
    try:
        data = json.loads(path.read_text())
        return RunRecord(str(data["run_id"]), str(data.get("launcher", "")), tuple(map(str, data["checkpoints"])))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PhalanxError(f"{path} is unreadable ({type(e).__name__}); it names the run this directory belongs "
                           "to: remove it together with the step-*.pt files, or choose another "
                           "--checkpoint-dir") from None


def write_run(directory: str | os.PathLike, record: RunRecord) -> None:
    """Atomically (temporary file, rename), so a reader sees the old record or the new one."""
    replace_private(Path(directory) / RUN_NAME, json.dumps(record._asdict()) + "\n")


def list_checkpoints(directory: str | os.PathLike, damaged: bool = False) -> list[Path]:
    """The directory's checkpoint files, oldest written first (by step where it has no run record);
    ``damaged``: with the sharded ones that lost their state file (to be tried, refused and named)."""
    root = Path(directory)
    record = read_run(root) if root.is_dir() else None
    wanted = (lambda p: is_checkpoint(p) or is_damaged_checkpoint(p)) if damaged else is_checkpoint
    if record is None:
        return [p for p in step_entries(root) if wanted(p)]
    return [root / name for name in record.checkpoints if wanted(root / name)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None
