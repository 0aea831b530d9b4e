"""One checkpoint for a model that lives in pieces.

Each stage's optimizer only knows its own parameters, numbered 0..k−1 in stage order. The
checkpoint renumbers them by position in the *whole* model's ``parameters()`` and merges the
stages, so the saved ``"optimizer"`` entry is exactly the ``state_dict()`` an optimizer over the
unsplit model would have (one param group listing every parameter; ``state`` keyed by that
index). With ``"model"`` being the unsplit ``state_dict()``, a pipeline checkpoint loads into
the plain model and its optimizer, and back into a pipeline with any partition.

The mapping ``local_to_global[i]`` is the whole-model index of the stage optimizer's i-th parameter.

That is ``PipelineRuntime.state_dict()``'s one object. The trainer's checkpoints are sharded
(:func:`by_name`, :func:`from_names`): each stage's optimizer state keyed by the unsplit model's
parameter names, which any partition can read.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import torch

from ...data.batch import to_cpu
from ...errors import PhalanxError
from ...checkpoint import read_entries


def to_global(local: dict[str, Any], local_to_global: Sequence[int]) -> dict[str, Any]:
    """A stage optimizer's ``state_dict()`` with whole-model parameter indices (CPU tensors)."""
    state = {local_to_global[int(i)]: to_cpu(s) for i, s in local["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [local_to_global[int(i)] for i in g["params"]]} for g in local["param_groups"]]
    return {"state": state, "param_groups": groups}


def merge(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The stages' globally numbered states as one optimizer ``state_dict()`` (stage order).

    Group g of the result lists the parameters of group g of every stage; its other settings
    (lr, momentum, ...) are the first stage's, which every stage shares (one schedule drives them).
    """
    counts = {len(p["param_groups"]) for p in parts}
    if len(counts) != 1:
        raise PhalanxError(f"stages disagree on the number of optimizer param groups ({sorted(counts)}); build the "
                           "optimizer the same way on every stage")
    state: dict[int, Any] = {}
    for part in parts:
        state.update(part["state"])
    groups = []
    for g, first in enumerate(parts[0]["param_groups"]):
        # (a set: a tied parameter is on two stages, saved once)
        params = sorted({i for part in parts for i in part["param_groups"][g]["params"]})
        groups.append({**{k: v for k, v in first.items() if k != "params"}, "params": params})
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def split(whole: dict[str, Any], local_to_global: Sequence[int]) -> dict[str, Any]:
    """This stage's share of a whole-model optimizer ``state_dict()``, renumbered 0..k−1."""
    to_local = {g: i for i, g in enumerate(local_to_global)}
    # Deep copies: the optimizer updates its state in place and must not write into the checkpoint.
    state = {to_local[int(g)]: copy.deepcopy(s) for g, s in whole["state"].items() if int(g) in to_local}
    groups = []
    for group in whole["param_groups"]:
        mine = [to_local[int(g)] for g in group["params"] if int(g) in to_local]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": mine})
    return {"state": state, "param_groups": groups}


# ---- by name: a sharded checkpoint's layout (each stage writes its own part; see checkpoint.py) ----


def group_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[list[str]]:
    """The parameter names of each param group of an optimizer over the unsplit ``model``, in its order."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def by_name(local: dict[str, Any], local_names: Sequence[str], whole_groups: Sequence[Sequence[str]]) -> dict[str, Any]:
    """A stage optimizer's ``state_dict()`` keyed by the unsplit model's parameter names (as torch's
    ``get_optimizer_state_dict`` keys fsdp's): ``state[name]`` for this stage's parameters, and every group
    listing all the names of the unsplit optimizer's group, so that every stage saves the same groups (DCP
    writes an entry that several ranks hold once) and another partition can find any parameter's state."""
    if len(local["param_groups"]) != len(whole_groups):
        raise PhalanxError(f"this stage's optimizer has {len(local['param_groups'])} param groups and the whole "
                           f"model's {len(whole_groups)}; build the optimizer the same way on every stage")
    state = {local_names[int(i)]: s for i, s in local["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
              for g, names in zip(local["param_groups"], whole_groups)]
    return {"state": state, "param_groups": groups}


def from_names(saved: dict[str, Any], local_names: Sequence[str], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What this stage's ``optimizer.load_state_dict`` takes from a state keyed by name (:func:`by_name`,
    written by any partition): its own parameters' state, each group's settings from the saved group."""
    saved_groups = saved.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups):
        raise PhalanxError(f"the checkpoint's optimizer has {len(saved_groups)} param groups and this run's "
                           f"{len(optimizer.param_groups)}; resume with the optimizer the checkpoint was trained with")
    index = {name: i for i, name in enumerate(local_names)}
    # (no copies: what was read is this stage's own, fresh from disk)
    state = {index[name]: s for name, s in saved.get("state", {}).items() if name in index}
    groups, start = [], 0
    for saved_group, group in zip(saved_groups, optimizer.param_groups):
        count = len(group["params"])  # a plain state_dict numbers the parameters on across the groups
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"},
                       "params": list(range(start, start + count))})
        start += count
    return {"state": state, "param_groups": groups}



def read_part(directory: str, keys: Sequence[str], names: Sequence[str], aliases: dict[str, str],
              optimizer: bool) -> tuple[dict[str, torch.Tensor], Optional[dict[str, Any]]]:
    """One stage's part of a sharded checkpoint, read by name whatever partition wrote it: the tensors under
    ``keys`` (the unsplit model's; a tied weight saved under its first key, ``aliases``) and, with
    ``optimizer``, the state of the parameters ``names`` with the param groups (None where it holds none)."""
    wanted = [f"model.{aliases.get(key, key)}" for key in keys]
    if optimizer:
        wanted += [f"optimizer.state.{name}" for name in names] + ["optimizer.param_groups"]
    found = read_entries(directory, wanted)
    weights = found.get("model", {})
    weights.update({key: weights[aliases[key]] for key in keys if key in aliases and aliases[key] in weights})
    missing = [key for key in keys if key not in weights]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise PhalanxError(f"checkpoint {directory} has no {', '.join(missing[:3])}{more} of this model; resume "
                           "with the --model the checkpoint was trained with")
    return weights, found.get("optimizer")
