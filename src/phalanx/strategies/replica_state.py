"""Each replica's own state in a checkpoint, beside the one model the run prints (local SGD, DiLoCo).

Between averagings the replicas of local SGD and DiLoCo differ: each rank's weights, buffers and
optimizer state are its own. On 2+ workers their checkpoint keeps both promises, as a sharded checkpoint
(``step-N.dcp/``, torch's distributed checkpoint, the format fsdp's are in: ``checkpoint/dcp.py``):

- ``model``: the one model the run prints and ``phalanx evaluate`` reads (local SGD: the replicas'
  average, computed for the checkpoint without changing them; DiLoCo: its global model), equal on every
  rank, so DCP writes it once; ``optimizer``: rank 0's, keyed by parameter name. Every strategy and
  worker count resumes from these two as from any sharded checkpoint;
- ``replicas.<rank>``: that rank's own ``model`` (parameters and buffers) and ``optimizer`` (by name),
  written by the rank itself into its own file (``__<rank>_0.distcp``): no rank gathers another's;
- what else the strategy keeps equal on every rank (DiLoCo: ``diloco``, its outer optimizer and the
  fragments that owe a round).

The checkpoint is written, sealed (the SHA-256 of every file) and renamed as every sharded one is, so the
atomic write, the verification on load and the retention are unchanged. A resume by the same strategy on
the same worker count gives each rank its own replica back (:func:`read`), and continues exactly; on
another worker count every rank starts from ``model``, and the header says so in one line.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..launcher import WorkerContext
from ..checkpoint import ALIASES, read_entries, with_aliases
from .replicas import average_buffers

REPLICAS = "replicas"


def parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter in the optimizer's numbering (its position across its param groups)."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A plain ``optimizer.state_dict()`` keyed by parameter names (DCP would make integer keys a list)."""
    return {"state": {names[int(i)]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                             for group in state["param_groups"]]}


def by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`by_name` (DCP drops an empty ``state``: plain SGD has none)."""
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state.get("state", {}).items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def averaged(module: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state averaged over the ranks (floating tensors: the mean; integer ones: rank 0's), as copies:
    the replicas stay as they are. A collective: every rank at the same point."""
    state = {name: t.detach().clone() for name, t in module.state_dict().items()}
    average_buffers(list(state.values()))
    return state


def shards(ctx: WorkerContext, model: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer,
           **equal: Any) -> dict[str, Any]:
    """This rank's part of the checkpoint: ``model`` (the printed one, equal on every rank), its own replica,
    rank 0's optimizer as the checkpoint's, and ``equal``: more state equal on every rank."""
    names = parameter_names(module, optimizer)
    own = {"model": module.state_dict(), "optimizer": by_name(optimizer.state_dict(), names)}
    main = {"optimizer": own["optimizer"]} if ctx.rank == 0 else {}
    return {"model": model, **main, REPLICAS: {str(ctx.rank): own}, **equal}


def read(state: dict[str, Any], ctx: WorkerContext, strategy: str, module: nn.Module, optimizer: torch.optim.Optimizer,
         equal: tuple[str, ...] = (), model: str = "their average") -> tuple[dict, Optional[dict], Optional[str]]:
    """(the checkpoint's whole state: ``model``, ``optimizer`` in this optimizer's numbering and the ``equal``
    entries; this rank's own replica, None where the checkpoint holds none for it; the header's line where
    the replicas were left for ``model``, what the checkpoint's model is to them). ``state``: any strategy's
    checkpoint as ``load_checkpoint`` gives it (a sharded one: still on disk)."""
    meta = state.get("meta", {})
    ours = meta.get("strategy") == strategy and meta.get("world_size", 0) > 1  # (one process: no replicas)
    mine = ours and meta["world_size"] == ctx.world_size
    note = None
    if ours and not mine:
        note = (f"{strategy}: the checkpoint holds {meta['world_size']} replicas of their own and this run has "
                f"{ctx.world_size} worker{'s' if ctx.world_size > 1 else ''}: every worker starts from {model} "
                f"(the replicas continue exactly only on {meta['world_size']} workers)")
    if "shards" not in state:  # a file (one process, a strategy that saves whole), or read whole already
        return state, None, note
    own_key = f"{REPLICAS}.{ctx.rank}"
    found = read_entries(state["shards"], [*state["shard_keys"], *equal, ALIASES, *([own_key] if mine else [])])
    names = parameter_names(module, optimizer)
    whole = {k: v for k, v in state.items() if k not in ("shards", "shard_keys", "files")}
    whole.update({key: found[key] for key in equal if key in found})
    whole["model"] = with_aliases(found["model"], found.get(ALIASES, {}))
    own = found.get(REPLICAS, {}).get(str(ctx.rank)) if mine else None
    if "optimizer" in found:
        whole["optimizer"] = by_index(found["optimizer"], names)
        if own is not None:
            own["optimizer"] = by_index(own["optimizer"], names)
    elif own is not None:  # the run changed optimizers: none is loaded
        own.pop("optimizer", None)
    return whole, own, note
