"""torch's distributed checkpoint (DCP), read without running anything the files ask for.

A sharded checkpoint is something users share ("init from the run my colleague trained"), so nothing in
it may run code when it is read. torch's own reader does not promise that: ``FileSystemReader`` reads
``.metadata`` with a plain ``pickle.load``, and the default load planner reads every non-tensor entry
(an optimizer's ``lr``, a list of names) with ``torch.load(weights_only=False)``; either runs whatever a
crafted file's ``__reduce__`` names. Here both go through a restricted unpickler:

- ``.metadata``: Python's own ``pickle.Unpickler`` whose ``find_class`` admits only the classes torch
  writes there (its metadata dataclasses, ``torch.Size``, dtypes, layouts, paths); anything else is
  refused before it is looked up, so nothing it names is imported or called. (torch's weights-only
  unpickler cannot do this: it reads only the pickle protocol ``torch.save`` uses, 2, and ``.metadata``
  is written with protocol 4.)
- non-tensor entries: ``torch.load(weights_only=True)``, as tensors already are read.

A refusal is a :class:`PhalanxError` naming the file. This module imports DCP, which takes seconds:
import it where a checkpoint is read, not at start-up.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import PhalanxError

METADATA = ".metadata"
_PATHS = {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}
#: module -> the names in it that torch writes into a ``.metadata`` (torch 2.4 to 2.13)
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "device"},  # and every dtype: see _allowed
    "collections": {"OrderedDict"},
    "pathlib": _PATHS,
    "pathlib._local": _PATHS,  # (Python 3.13's home of the same classes)
}


class Refused(pickle.UnpicklingError):
    """A pickle named something a checkpoint never holds."""


def _allowed(module: str, name: str) -> bool:
    if name in ALLOWED.get(module, ()):
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that finds only the classes torch writes into a DCP ``.metadata``."""

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise Refused(f"{module}.{name}")
        return super().find_class(module, name)


def refused(path: Path, what: str) -> PhalanxError:
    return PhalanxError(f"{path} is refused: it names {what}, which a checkpoint never holds (a file made to run "
                        f"code when read); nothing in it was run; use a checkpoint from a source you trust")


def read_metadata(directory: str | Path) -> Metadata:
    """DCP's index of the checkpoint in ``directory``, read through :class:`MetadataUnpickler`."""
    path = Path(directory) / METADATA
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except Refused as e:
        raise refused(path, str(e)) from None
    except Exception as e:  # a cut or garbled file: pickle raises many types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise PhalanxError(f"checkpoint {path.parent} is corrupt: its {METADATA} is unreadable ({first}); give an "
                           "earlier checkpoint of the same directory") from None
    if not isinstance(metadata, Metadata):
        raise PhalanxError(f"{path} is not a distributed checkpoint's index (it holds a {type(metadata).__name__})")
    return metadata


class SafeReader(FileSystemReader):
    """torch's ``FileSystemReader`` with its ``.metadata`` read by :func:`read_metadata`, once (at construction,
    so a refusal is this one line, not the aggregate DCP makes of a failed collective step)."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        self.metadata = read_metadata(path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:  # (another checkpoint: its own index, read as safely)
            self.metadata = read_metadata(Path(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # a rank-local index: phalanx never writes one
            raise FileNotFoundError(f"{self.path}: no rank-local metadata")
        meta = getattr(self.metadata, "storage_meta", None)
        if meta is None:  # (what torch's read_metadata does after loading)
            meta = self.metadata.storage_meta = StorageMeta()
        meta.load_id = self.load_id
        return self.metadata


class _SafeBytes(DefaultLoadPlanner):
    """A load planner's ``load_bytes`` with ``weights_only=True`` (torch's default planner has False)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            what = (str(e).strip().splitlines() or ["an object"])[0][:160]
            raise PhalanxError(f"checkpoint entry {fqn} is refused: {what}; nothing in it was run; use a "
                               "checkpoint from a source you trust") from None
        if self.flatten_state_dict:  # (what torch's planner does with what it loaded)
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafePlanner(_SafeBytes):
    """DCP's default load planner (fills the state dict it is given), non-tensor entries read weights-only."""


class SafeEmptyPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """DCP's "empty" planner (rebuilds the entries from the metadata), non-tensor entries read weights-only."""


def unwrapped(e: CheckpointException) -> BaseException:
    """The PhalanxError a DCP step raised on some rank (DCP wraps every rank's error, with its traceback, in a
    CheckpointException); ``e`` itself where none did."""
    for failure in getattr(e, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, PhalanxError):
            return inner
    return e
