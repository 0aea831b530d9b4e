"""Checkpoints you can trust: atomic, checksummed, verified on load, one job per directory.

- **Atomic.** Written to a temporary file, fsynced, renamed: ``os.replace`` within one directory
  is atomic, so a kill at any moment leaves the previous checkpoint or the new one, never a torn
  file. Files are named ``step-00000120.pt`` so the newest is found by name.
- **Sharded** (``step-00000120.dcp/``, a directory): each rank writes its own shard with torch's
  distributed checkpoint, the same guarantees kept; see ``dcp.py``. Everything here takes both.
- **Checksummed.** Every checkpoint holds the SHA-256 of its payload (every tensor's bytes,
  dtype and shape, every other value, by key), recomputed and compared on load: a byte flipped
  on disk is found before it is trained on. torch's own zip reader does not check.
- **Verified resume.** ``--resume DIR`` takes the newest checkpoint that verifies and names any
  newer one it skipped.
- **Storage errors** (disk full, permission denied) are one line naming the previous good
  checkpoint; the half-written temporary file is removed.
- **One job per directory.** :class:`DirectoryLock` (``flock`` on ``.phalanx.lock``, released by
  the kernel when the holder dies, so it is never stale) refuses a second job, naming the first.

- **Private.** Files 0600, the directories phalanx creates 0700, whatever the umask (``files.py``).

Everything loads with ``torch.load(weights_only=True)`` (tensors, numbers, strings, lists, dicts); a sharded
checkpoint's DCP index and entries through a restricted unpickler (``safe_read.py``): nothing read runs code.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

from ..errors import PhalanxError, StorageError
from ..files import PRIVATE_FILE, private_dir, replace_private
from . import dcp as sharded

FORMAT = "phalanx-checkpoint-1"
LOCK_NAME = ".phalanx.lock"
RUN_NAME = ".phalanx-run.json"
_NAME = re.compile(r"^step-(\d+)\.(pt|dcp)$")


def checkpoint_path(directory: str | os.PathLike, step: int, sharded: bool = False) -> Path:
    return Path(directory) / f"step-{step:08d}.{'dcp' if sharded else 'pt'}"


def is_checkpoint(p: Path) -> bool:
    """A finished checkpoint: a file, or a sharded one's directory (it has its state file only once renamed)."""
    return p.is_file() or (p.suffix == ".dcp" and (p / sharded.STATE).is_file())


def is_damaged_checkpoint(p: Path) -> bool:
    """A sharded checkpoint's directory without its state file: renamed only once complete, so one damaged
    since (its ``phalanx.pt`` lost); read, it is refused as incomplete, and a directory read falls back."""
    return p.suffix == ".dcp" and p.is_dir() and not (p / sharded.STATE).is_file()


def remove(p: Path) -> None:
    """Delete a checkpoint, a file or a sharded one's directory."""
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


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


def step_entries(directory: str | os.PathLike) -> list[Path]:
    """Everything in ``directory`` named like a checkpoint (files or not), in step order."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


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


def to_cpu(obj: Any) -> Any:
    """A copy of nested dicts/lists/tuples with every tensor on the CPU (checkpoints load anywhere)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def payload_digest(state: dict[str, Any]) -> str:
    """SHA-256 of everything in ``state`` but its own checksum: tensors by bytes, dtype and shape."""
    digest = hashlib.sha256()

    def walk(obj: Any, where: str) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            digest.update(f"{where}:{t.dtype}:{tuple(t.shape)};".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                walk(obj[key], f"{where}/{key}")
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(value, f"{where}[{i}]")
        else:
            digest.update(f"{where}={obj!r};".encode())

    walk({k: v for k, v in state.items() if k not in ("checksum", "path", "skipped")}, "")
    return digest.hexdigest()


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete half-written checkpoints that a killed run left behind (never a finished one): files, and
    the temporary directories of sharded ones."""
    root = Path(directory)
    stale = [*root.glob(".step-*.pt.*.tmp"), *root.glob(f".{RUN_NAME}.tmp"), *root.glob(".step-*.dcp*.tmp")] \
        if root.is_dir() else []
    for p in stale:
        remove(p)
    return stale


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


def commit(directory: str | os.PathLike, final: Path, run_id: str, keep: int, write: Any) -> Path:
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


def storage_error(e: BaseException, target: Path, previous: Optional[Path]) -> BaseException:
    """The one-line StorageError for ``e`` where a storage error caused it (else ``e`` itself)."""
    cause = os_error(e)
    return e if cause is None else _storage_error(cause, target, previous)


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


def os_error(e: BaseException) -> Optional[OSError]:
    """The OSError behind ``e``: torch's zip writer reports a full disk as a RuntimeError ("unexpected
    pos ...") raised while handling the OSError."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError):
            return e
        e, seen = (e.__cause__ or e.__context__), seen + 1
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


def _read(p: Path, use: str = "--resume") -> dict[str, Any]:
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


def load_checkpoint(path: str | os.PathLike, use: str = "--resume", verify: bool = True) -> dict[str, Any]:
    """Load a verified checkpoint: a file, a sharded one's directory, or the newest one in a directory
    that verifies.

    From a directory, ``state["skipped"]`` lists (path, why) of every newer checkpoint that did not.
    ``use``: the flag or command the path was given to, named in the messages. A sharded checkpoint
    comes without its tensors (``state["shards"]`` names its directory; :func:`tensors` reads them);
    ``verify=False`` skips hashing its shards, for a worker whose plan verified them already.
    """
    p = Path(path)
    if p.is_dir() and _NAME.match(p.name) and p.suffix == ".dcp":
        return sharded.read(p, use, verify)
    if p.is_dir():
        found = list_checkpoints(p, damaged=True)
        if not found:
            raise PhalanxError(f"no checkpoint (step-*.pt) in {p}; train first, or pass a checkpoint file to {use}")
        skipped: list[tuple[str, str]] = []
        for candidate in reversed(found):
            try:
                state = sharded.read(candidate, use, verify) if candidate.is_dir() else _read(candidate, use)
            except PhalanxError as e:
                skipped.append((str(candidate), str(e)))
                continue
            state["skipped"] = skipped
            return state
        raise PhalanxError(f"no checkpoint in {p} verifies ({len(found)} tried, newest {found[-1].name}: "
                           f"{skipped[0][1]})")
    if not p.is_file():
        raise PhalanxError(f"checkpoint {p} does not exist; pass an existing file or directory to {use}")
    return _read(p, use)


def warn_skipped(state: dict[str, Any]) -> None:
    """One warning for each newer checkpoint a directory's read skipped (it did not verify), naming why."""
    for path, why in state.get("skipped", []):
        reason = why.split("; resume from")[0].split("; give")[0]
        warnings.warn(f"skipped {path}, newer than {Path(state['path']).name}: {reason}")


def tensors(state: dict[str, Any], optimizer: bool = True) -> dict[str, Any]:
    """``state`` with its model (and optimizer) state in this process: a sharded checkpoint's shards read
    and joined (the whole model in one process: for one that runs it whole), a file's as it is."""
    return sharded.joined(state, optimizer) if "shards" in state else state


def without_optimizer(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as a run that changed optimizers loads it: the parameters only."""
    if "shards" in state:
        return {**state, "shard_keys": ["model"]}
    return {k: v for k, v in state.items() if k != "optimizer"}


def shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every saved tensor of the model, by name, and its shape (a sharded checkpoint records them)."""
    if "model" in state:
        return {name: tuple(t.shape) for name, t in state["model"].items()}
    return {name: tuple(shape) for name, shape in state["meta"]["parameter_shapes"].items()}


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
