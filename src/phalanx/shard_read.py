"""Reading a sharded checkpoint (torch's distributed checkpoint) without a template or a process group.

DCP's own ``dcp.load`` fills the tensors it is given, so a reader must first build a state dict of the
right shapes (fsdp does: its runtime's shards). Whatever holds no such template (one process reading
the whole model for ``evaluate``, ``--init-from`` or sync; a pipeline stage reading its own blocks
whatever partition wrote them) reads by name instead: torch's "empty" planner rebuilds the entries from
the checkpoint's own metadata, and only the entries asked for are read from disk.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional


def read_entries(directory: str, wanted: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """The checkpoint's entries under ``wanted`` (top-level keys like ``"model"``, or dotted paths into them
    like ``"model.0.weight"`` or ``"optimizer.state.0.weight"``; None: everything), nested as saved. Reads in
    this process only (no collective), so each rank of a job may read its own part."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    found: dict[str, Any] = {}
    # What torch's dcp_to_torch_save does, in memory; no_dist: this process reads every entry it plans.
    keys = None if wanted is None else set(wanted)
    _load_state_dict(found, storage_reader=FileSystemReader(directory),
                     planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    return found
