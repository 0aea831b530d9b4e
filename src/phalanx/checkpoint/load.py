"""Any checkpoint, loaded and verified: a file, a sharded one's directory, or the newest in a run's directory
that verifies.

``--resume DIR`` (and ``evaluate``, ``--init-from``) take the newest checkpoint that verifies and name each
newer one they skipped, with why; a path given that does not verify is one line naming what is wrong with it
and what to give instead.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from ..errors import PhalanxError
from . import dcp, pt
from .format import list_checkpoints, step_of


def load_checkpoint(path: str | os.PathLike, use: str = "--resume", verify: bool = True) -> dict[str, Any]:
    """Load a verified checkpoint: a file, a sharded one's directory, or the newest one in a directory
    that verifies.

    From a directory, ``state["skipped"]`` lists (path, why) of every newer checkpoint that did not.
    ``use``: the flag or command the path was given to, named in the messages. A sharded checkpoint
    comes without its tensors (``state["shards"]`` names its directory; ``convert.tensors`` reads them);
    ``verify=False`` skips hashing its shards, for a worker whose plan verified them already.
    """
    p = Path(path)
    if p.is_dir() and step_of(p) is not None and p.suffix == ".dcp":
        return dcp.read(p, use, verify)
    if p.is_dir():
        found = list_checkpoints(p, damaged=True)
        if not found:
            raise PhalanxError(f"no checkpoint (step-*.pt) in {p}; train first, or pass a checkpoint file to {use}")
        skipped: list[tuple[str, str]] = []
        for candidate in reversed(found):
            try:
                state = dcp.read(candidate, use, verify) if candidate.is_dir() else pt.read(candidate, use)
            except PhalanxError as e:
                skipped.append((str(candidate), str(e)))
                continue
            state["skipped"] = skipped
            return state
        raise PhalanxError(f"no checkpoint in {p} verifies ({len(found)} tried, newest {found[-1].name}: "
                           f"{skipped[0][1]})")
    if not p.is_file():
        raise PhalanxError(f"checkpoint {p} does not exist; pass an existing file or directory to {use}")
    return pt.read(p, use)


def warn_skipped(state: dict[str, Any]) -> None:
    """One warning for each newer checkpoint a directory's read skipped (it did not verify), naming why."""
    for path, why in state.get("skipped", []):
        reason = why.split("; resume from")[0].split("; give")[0]
        warnings.warn(f"skipped {path}, newer than {Path(state['path']).name}: {reason}")
