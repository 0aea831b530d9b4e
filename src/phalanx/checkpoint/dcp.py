"""Sharded checkpoints: every rank writes its own shard with torch's distributed checkpoint (DCP).

A strategy whose ranks each hold a part of the model (fsdp or a pipeline on 2+ workers), or a replica of
its own (local-sgd, diloco: ``strategies/replica_state.py``), saves a directory, ``step-00000120.dcp/``, and
no rank ever gathers the whole model:

- ``__<rank>_<n>.distcp``: that rank's shards of the parameters and of the optimizer state, written
  by the rank itself (DCP's files);
- ``.metadata``: DCP's index, which slice of which tensor lies where: it is what lets any worker
  count read the checkpoint back (DCP reshards on load), or one process read it whole;
- ``phalanx.pt``: the loop's own small state (step, data position, RNG, scheduler, run id,
  settings and the parameters' shapes), the SHA-256 of every other file, and its own checksum.

The guarantees of the single-file checkpoints hold:

- **Atomic.** Everything is written into ``.step-00000120.dcp.tmp/``; rank 0 renames that directory
  once DCP's save has returned on it. DCP's coordinator (rank 0) gathers every rank's write result
  before it writes ``.metadata``, so by then every rank's files are written and fsynced. A kill at any
  moment leaves the previous checkpoint and a temporary directory, which the next run removes.
- **Checksummed.** DCP's metadata records where each tensor lies, not what its bytes are, and its
  reader checks nothing: a flipped byte would load silently. So rank 0 hashes every file before the
  rename, and every load verifies them (streamed: no file is held in memory).
- **Retention and the run id** are the single-file ones (``directory.commit``): the run record names
  the directory before the rename; the oldest beyond ``--keep-checkpoints`` are removed.

``--async-checkpoint``: ``dcp.async_save`` copies this rank's shards to CPU memory (the only time
the step waits), then writes them in a thread over a gloo process group of its own (collectives of
a background thread must not interleave with the training's own on the default group). The loop
waits for a save before it starts the next one and before it exits; rank 0 seals the checkpoint
(checksums, rename) in that thread once the write is done.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..data.batch import to_cpu
from ..errors import PhalanxError, StorageError
from ..files import PRIVATE_DIR, PRIVATE_FILE
from .directory import commit, os_error, storage_error
from .format import FORMAT, STATE, checkpoint_path, latest_checkpoint, remove
from .integrity import file_digest, payload_digest
from .pt import write_file

#: what a sharded checkpoint's tensors are saved under (as the runtime's ``shard_state_dict`` keys them)
KEYS = ("model", "optimizer")


def temporary(final: Path) -> Path:
    """Where the checkpoint ``final`` is written before it is renamed (the same directory: rename is atomic)."""
    return final.parent / f".{final.name}.tmp"


class ShardWriter:
    """This rank's part of every sharded checkpoint of a run; one save in flight at a time."""

    def __init__(self, ctx: Any, asynchronous: bool):
        self.ctx, self.asynchronous = ctx, asynchronous
        self.group: Optional[Any] = None  #: the gloo group the background writes use (made at the first)
        self.pending: Optional[concurrent.futures.Future] = None
        self.thread = concurrent.futures.ThreadPoolExecutor(1, "phalanx-checkpoint") if asynchronous else None

    def save(self, shards: dict[str, Any], state: dict[str, Any], directory: str, step: int, keep: int) -> Path:
        """On every rank (collectives): its ``shards`` into the checkpoint of ``step``; rank 0 adds ``state``
        (the loop's small state) and seals it. Returns the checkpoint's path (once :meth:`wait` returned,
        under --async-checkpoint)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        self.wait()
        final = checkpoint_path(directory, step, sharded=True)
        tmp, previous = temporary(final), latest_checkpoint(directory)
        if self.ctx.rank == 0:
            try:
                remove(tmp)  # a save of this step that an earlier attempt left unfinished
                tmp.mkdir(mode=PRIVATE_DIR)  # no one else reaches the files torch writes into it
            except OSError as e:
                raise storage_error(e, final, previous) from None
        dist.barrier()  # every rank writes into the directory rank 0 made, empty
        if self.thread is None:  # (not --async-checkpoint)
            try:
                dcp.save(shards, storage_writer=writer(tmp))
            except _errors() as e:
                raise _failed(e, final, previous) from None
            self._seal(tmp, final, state, keep, previous)
            return final
        if self.group is None:
            self.group = dist.new_group(backend="gloo")
        saving = dcp.async_save(shards, storage_writer=writer(tmp), process_group=self.group)
        # (a response object where staging is async too)
        upload = saving.upload_completion if isinstance(saving, AsyncSaveResponse) else saving
        self.pending = self.thread.submit(self._finish, upload, tmp, final, state, keep, previous)
        return final

    def _finish(self, upload: concurrent.futures.Future, tmp: Path, final: Path, state: dict[str, Any], keep: int,
                previous: Optional[Path]) -> None:
        try:
            upload.result()
        except _errors() as e:
            raise _failed(e, final, previous) from None
        self._seal(tmp, final, state, keep, previous)

    def _seal(self, tmp: Path, final: Path, state: dict[str, Any], keep: int, previous: Optional[Path]) -> None:
        if self.ctx.rank == 0:
            commit(final.parent, final, str(state.get("run_id") or ""), keep, lambda f: seal(tmp, f, state))

    def wait(self) -> None:
        """Until the save in flight (if any) is written and sealed; its error, if it failed."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.shutdown(wait=False)


def writer(tmp: Path) -> Any:
    """DCP's file writer, whose storage errors keep their errno on the way to rank 0.

    torch's zip writer reports a write the disk refused as a RuntimeError (``[enforce fail at
    inline_container.cc:672] . unexpected pos 704 vs 598``) raised while handling the OSError; DCP pickles
    every rank's error to its coordinator, and pickling drops ``__context__``: a full disk read as that
    line, exit 2 (ENOSPC was said only where the OSError itself was raised). Here the OSError is raised."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            try:
                return super().write_data(plan, planner)
            except Exception as e:
                cause = os_error(e)
                if cause is None or cause is e:
                    raise
                raise OSError(cause.errno, cause.strerror, cause.filename) from None

    return Writer(str(tmp))


def _errors() -> tuple[type[BaseException], ...]:
    """What a failed DCP save raises: its CheckpointException is a BaseException (not an Exception)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return Exception, CheckpointException


def _failed(e: BaseException, final: Path, previous: Optional[Path]) -> BaseException:
    """One line for a failed DCP save: DCP wraps every rank's error in a CheckpointException."""
    failures = getattr(e, "failures", None) or {}
    inner = next((failure[0] for failure in failures.values()), e)
    error = storage_error(inner, final, previous)
    if isinstance(error, StorageError):
        return error
    first = (str(inner).strip().splitlines() or [type(inner).__name__])[0][:160]
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    return PhalanxError(f"cannot write checkpoint {final}: {first}; {kept}")


def seal(tmp: Path, final: Path, state: dict[str, Any]) -> None:
    """Rank 0, once every rank's shards are in ``tmp``: their checksums and ``state`` into its state file,
    then ``tmp`` renamed to ``final`` (an older ``final`` of the same step is replaced)."""
    payload = to_cpu(state)
    files = [p for p in sorted(tmp.iterdir()) if p.is_file()]
    for p in files:  # 0600 as a .pt is (torch's open() made them 0666 less the umask)
        with contextlib.suppress(PermissionError):  # (another node's rank wrote it as another user)
            os.chmod(p, PRIVATE_FILE)
    payload["files"] = {p.name: file_digest(p) for p in files}
    payload["checksum"] = payload_digest(payload)
    write_file(payload, tmp / STATE)
    _fsync_directory(tmp)
    if final.exists():  # rename(2) does not replace a directory that has files: move it aside first
        old = final.parent / f".{final.name}.old.tmp"
        remove(old)
        os.replace(final, old)
        os.replace(tmp, final)
        remove(old)
    else:
        os.replace(tmp, final)
    _fsync_directory(final.parent)


def _fsync_directory(path: Path) -> None:
    """The directory's entries (a new file, a rename) on disk, not only the files' bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- reading


def read(p: Path, use: str = "--resume", verify: bool = True) -> dict[str, Any]:
    """A sharded checkpoint's small state, every file verified against its checksum (``verify``); its
    tensors stay on disk (``state["shards"]``: the directory; ``convert.joined`` or the runtime reads them)."""
    earlier = f"{'resume from' if use == '--resume' else f'give {use}'} an earlier checkpoint of the same directory"
    if not (p / STATE).is_file():  # written last, before the rename: lost since (see is_damaged_checkpoint)
        raise PhalanxError(f"checkpoint {p} is incomplete: its {STATE} is missing; {earlier}")
    try:
        state = torch.load(p / STATE, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        if first.startswith("Weights only load failed"):  # (weights_only: nothing it names was run)
            first = "it holds objects a checkpoint never holds; nothing in it was run"
        raise PhalanxError(f"checkpoint {p} is corrupt: its {STATE} is unreadable ({first}); {earlier}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or "files" not in state:
        raise PhalanxError(f"{p} is not a phalanx checkpoint; pass a step-* checkpoint written by phalanx train")
    if payload_digest(state) != state.get("checksum"):
        raise PhalanxError(f"checkpoint {p} is corrupt (its {STATE} does not match its checksum); {earlier}")
    for name, expected in state["files"].items() if verify else ():
        if not (p / name).is_file():
            raise PhalanxError(f"checkpoint {p} is incomplete: its shard {name} is missing; {earlier}")
        if file_digest(p / name) != expected:
            raise PhalanxError(f"checkpoint {p} is corrupt: its shard {name} does not match its checksum (the file "
                               f"changed after it was written); {earlier}")
    if verify:  # its checksums are no signature: whoever made the files made them too. Refused here, in one line.
        from .safe_read import read_metadata

        read_metadata(p)
    state.update(path=str(p), shards=str(p), shard_keys=list(KEYS))
    return state
