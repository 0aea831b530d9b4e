"""Reading a sharded checkpoint (torch's distributed checkpoint) without a template or a process group.

DCP's own ``dcp.load`` fills the tensors it is given, so a reader must first build a state dict of the
right shapes (fsdp does: its runtime's shards). Whatever holds no such template (one process reading
the whole model for ``evaluate``, ``--init-from`` or sync; a pipeline stage reading its own blocks
whatever partition wrote them) reads by name instead: torch's "empty" planner rebuilds the entries from
the checkpoint's own metadata, and only the entries asked for are read from disk. Nothing read runs code:
``.metadata`` and the non-tensor entries go through a restricted unpickler (``safe_read``).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from torch import nn

#: the entry where a runtime saves the keys of a tied weight it wrote once (other key -> the saved one)
ALIASES = "aliases"


def read_entries(directory: str, wanted: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """The checkpoint's entries under ``wanted`` (top-level keys like ``"model"``, or dotted paths into them
    like ``"model.0.weight"`` or ``"optimizer.state.0.weight"``; None: everything), nested as saved. Reads in
    this process only (no collective), so each rank of a job may read its own part."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from .safe_read import SafeEmptyPlanner, SafeReader, unwrapped

    found: dict[str, Any] = {}
    # What torch's dcp_to_torch_save does, in memory; no_dist: this process reads every entry it plans.
    # Its reader and planner, but reading nothing that could run code (see safe_read).
    keys = None if wanted is None else set(wanted)
    try:
        _load_state_dict(found, storage_reader=SafeReader(directory), planner=SafeEmptyPlanner(keys=keys),
                         no_dist=True)
    except CheckpointException as e:
        raise unwrapped(e) from None
    return found


def model_aliases(model: nn.Module) -> dict[str, str]:
    """Each key of ``model.state_dict()`` that names a tensor an earlier key names too (a tied weight: a GPT's
    ``lm_head.weight`` is its ``transformer.wte.weight``), and that earlier key. A pipeline's sharded checkpoint
    saves the tensor once, under the earlier key, and its readers give it both names again."""
    first: dict[int, str] = {}
    found = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            found[key] = first[id(tensor)]
        else:
            first[id(tensor)] = key
    return found


def with_aliases(model: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """The model's state under every key again: a tied weight, saved once under its first key, also under the
    others that name it (``aliases``: other key -> the saved one), as ``model.state_dict()`` lists it."""
    return {**model, **{alias: model[key] for alias, key in aliases.items() if key in model}}
