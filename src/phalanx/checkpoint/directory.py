"""A run's checkpoint directory: proven writable, held by one job, cleared of what a killed run left, and each
new checkpoint committed into it.

- **Committed.** The run record names a checkpoint before it exists (a name without a checkpoint is skipped
  by every reader), so a kill between the two never leaves a checkpoint the record does not know; the oldest
  beyond ``--keep-checkpoints`` are then removed, their names first.
- **Storage errors** (disk full, permission denied) are one line naming the previous good checkpoint; the
  half-written temporary is removed.
- **One job per directory.** :class:`DirectoryLock` (``flock`` on ``.phalanx.lock``, released by the kernel
  when the holder dies, so it is never stale) refuses a second job, naming the first.
- **Private.** Files 0600, the directories phalanx creates 0700, whatever the umask (``files.py``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import PhalanxError, StorageError
from ..files import PRIVATE_FILE, private_dir
from .format import (LOCK_NAME, RUN_NAME, RunRecord, latest_checkpoint, list_checkpoints, read_run, remove,
                     write_run)


def ensure_writable(directory: str | os.PathLike) -> Path:
    """Create ``directory`` if needed and prove a file can be written there (then remove it)."""
    root = Path(directory)
    try:
        private_dir(root)
        fd, probe = tempfile.mkstemp(prefix=".phalanx-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PhalanxError(
            f"cannot write checkpoints to {root}: {e.strerror or e}; choose another --checkpoint-dir"
        ) from None
    return root


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete half-written checkpoints that a killed run left behind (never a finished one): files, and
    the temporary directories of sharded ones."""
    root = Path(directory)
    stale = [*root.glob(".step-*.pt.*.tmp"), *root.glob(f".{RUN_NAME}.tmp"), *root.glob(".step-*.dcp*.tmp")] \
        if root.is_dir() else []
    for p in stale:
        remove(p)
    return stale


def commit(directory: str | os.PathLike, final: Path, run_id: str, keep: int, write: Callable[[Path], Any]) -> Path:
    """Make ``final`` the run's newest checkpoint: ``write(final)`` puts it there atomically, then all but the
    ``keep`` written last are removed. The run record names it before it exists (a name without a checkpoint
    is skipped by every reader), so a kill between the two never leaves a checkpoint the record does not know."""
    root = Path(directory)
    previous = latest_checkpoint(root)
    record = read_run(root)
    try:
        order = [p.name for p in list_checkpoints(root) if p.name != final.name] + [final.name]
        mine = record or RunRecord(run_id, "", ())
        write_run(root, mine._replace(checkpoints=tuple(order)))
        write(final)
    except BaseException as e:
        _restore_record(root, record)  # an overwritten step did not become the newest
        error = storage_error(e, final, previous)
        if error is e:
            raise
        raise error from None
    _keep_newest(root, keep)
    return final


def _restore_record(root: Path, record: Optional[RunRecord]) -> None:
    try:
        if record is not None:
            write_run(root, record)
    except OSError:
        pass  # the disk that refused the checkpoint may refuse this too; a missing name is skipped anyway


def _keep_newest(root: Path, keep: int) -> None:
    """Remove all but the ``keep`` checkpoints written last; the record first drops their names."""
    written = list_checkpoints(root)
    if keep <= 0 or len(written) <= keep:
        return
    record = read_run(root)
    if record is not None:
        write_run(root, record._replace(checkpoints=tuple(p.name for p in written[-keep:])))
    for old in written[:-keep]:
        remove(old)


def storage_error(e: BaseException, target: Path, previous: Optional[Path]) -> BaseException:
    """The one-line StorageError for ``e`` where a storage error caused it (else ``e`` itself)."""
    cause = os_error(e)
    return e if cause is None else _storage_error(cause, target, previous)


def os_error(e: BaseException) -> Optional[OSError]:
    """The OSError behind ``e``: torch's zip writer reports a full disk as a RuntimeError ("unexpected
    pos ...") raised while handling the OSError."""
    link: Optional[BaseException] = e
    seen = 0
    while link is not None and seen < 10:
        if isinstance(link, OSError):
            return link
        link, seen = (link.__cause__ or link.__context__), seen + 1
    return None


def _storage_error(e: OSError, target: Path, previous: Optional[Path]) -> StorageError:
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    why = f"{e.strerror or e}{f' ({code})' if code else ''}"
    if previous is None:
        kept = "no earlier checkpoint exists"
        then = "then run again"
    else:
        kept = f"nothing was lost: the previous checkpoint {previous} is intact"
        then = f"then continue with --resume {previous}"
    if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST) and target.is_dir():
        return StorageError(f"cannot write checkpoint {target}: a directory of that name is in the way (not a "
                            f"checkpoint); {kept}; move it out of --checkpoint-dir, {then}")
    fix = "free some space" if e.errno == errno.ENOSPC else "fix the directory's permissions"
    return StorageError(f"cannot write checkpoint {target}: {why}; {kept}; {fix} or choose another "
                        f"--checkpoint-dir, {then}")


class DirectoryLock:
    """Hold ``<directory>/.phalanx.lock`` for a job's life: a second job on the directory is refused.

    ``flock`` is released by the kernel when the holding process exits, however it exits, so a
    lock is never left behind by a crash.
    """

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / LOCK_NAME
        self.fd: Optional[int] = None

    def acquire(self) -> "DirectoryLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise PhalanxError(f"checkpoint directory {self.path.parent} is in use by another phalanx job "
                               f"({holder}); wait for it to finish, or choose another --checkpoint-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __enter__(self) -> "DirectoryLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
