"""What a run writes is its user's alone: files 0600, the folders phalanx creates 0700, whatever the umask.

A run directory holds what the next run reads back (checkpoints, the run record naming them, the metrics a
resume continues). Under a permissive umask (000, common in containers) another local user could rewrite
them; so each is created with its mode given (``os.open``'s, ``mkdir``'s: the umask can only take bits
away), never created first and narrowed after. Files that torch writes itself (a sharded checkpoint's
shards and ``.metadata``) are written into a folder created 0700, where no one else can reach them, and
narrowed to 0600 before that folder is renamed into place (``checkpoint/dcp.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` and every missing folder above it, each created 0700 (``os.makedirs`` gives its mode to the
    last one only); an existing one is left as it is."""
    path = Path(path)
    for folder in [*reversed(path.parents), path]:
        if not folder.is_dir():
            try:
                folder.mkdir(mode=PRIVATE_DIR)
            except FileExistsError:  # made meanwhile (another rank), or a file: the caller's next step says so
                pass
    return path


def _opener(path: str, flags: int) -> int:
    fd = os.open(path, flags, PRIVATE_FILE)
    try:
        os.fchmod(fd, PRIVATE_FILE)  # one that existed keeps its mode otherwise (a metrics file appended to)
    except PermissionError:  # someone else's file we may write: not ours to change
        pass
    return fd


def open_private(path: str | os.PathLike, mode: str = "w", **kwargs: Any) -> IO:
    """``open(path, mode)``, the file 0600."""
    return open(path, mode, opener=_opener, **kwargs)


def write_private(path: str | os.PathLike, text: str) -> None:
    with open_private(path, "w") as f:
        f.write(text)


def replace_private(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` at once (a temporary beside it, renamed over it): a reader sees the old
    file or the new one, never half of one; 0600 as :func:`write_private`."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    write_private(temporary, text)
    os.replace(temporary, path)
