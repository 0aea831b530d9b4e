"""A checkpoint in the form its reader needs, whatever wrote it.

Every strategy reads every checkpoint: a sharded one (fsdp, a pipeline, local SGD's and DiLoCo's replicas)
read whole into one process for whatever runs the model whole (sync, one process, ``phalanx evaluate``,
``--init-from``), its optimizer state numbered as a plain optimizer numbers it; a checkpoint without its
optimizer state, for a run that changed optimizers; its parameters' shapes, compared before a run starts.
"""

from __future__ import annotations

from typing import Any

from .entries import ALIASES, read_entries, with_aliases


def tensors(state: dict[str, Any], optimizer: bool = True) -> dict[str, Any]:
    """``state`` with its model (and optimizer) state in this process: a sharded checkpoint's shards read
    and joined (the whole model in one process: for one that runs it whole), a file's as it is."""
    return joined(state, optimizer) if "shards" in state else state


def joined(state: dict[str, Any], optimizer: bool = True) -> dict[str, Any]:
    """``state`` with the whole model (and optimizer state, in a plain optimizer's numbering) read into this
    process from its shards: what a single-file checkpoint holds, for whatever runs the model whole
    (sync, one process, ``phalanx evaluate``, ``--init-from``). No process group is needed or used."""
    wanted = [key for key in state["shard_keys"] if optimizer or key == "model"]
    found = read_entries(state["shards"], [*wanted, ALIASES])
    plain = {k: v for k, v in state.items() if k not in ("shards", "shard_keys", "files")}
    plain["model"] = with_aliases(found["model"], found.get(ALIASES, {}))
    if "optimizer" in found:
        plain["optimizer"] = plain_numbering(found["optimizer"])
    return plain


def plain_numbering(state: dict[str, Any]) -> dict[str, Any]:
    """DCP's optimizer state (keyed by parameter name) numbered as ``optimizer.state_dict()`` numbers it:
    a plain optimizer's parameter i is the i-th name across the param groups (the same factory lists
    the same parameters in the same order, sharded or not)."""
    index = {name: i for i, name in enumerate(n for group in state["param_groups"] for n in group["params"])}
    ordered = sorted(state.get("state", {}).items(), key=lambda item: index[item[0]])  # (none: plain SGD)
    return {"state": {index[name]: value for name, value in ordered},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


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
