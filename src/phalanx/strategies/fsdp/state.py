"""An optimizer state in two numberings: a plain optimizer's (by index) and the distributed checkpoint's (by name).

Pure. fsdp's optimizer holds the sharded parameters; torch's ``get_state_dict`` keys its state by
parameter name, while a plain optimizer's ``state_dict()`` (what sync and one process save) numbers
parameters by position across its param groups. These two functions turn one into the other.
"""

from __future__ import annotations

from typing import Any

from ...errors import PhalanxError


def by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A name-keyed optimizer state (torch's distributed-checkpoint form) as ``optimizer.state_dict()`` keys it.

    ``names[i]`` is the name of the parameter a plain optimizer numbers i (its position across the
    optimizer's param groups), so the result is exactly the dict the unsplit model's optimizer saves.
    """
    index = {name: i for i, name in enumerate(names)}
    ordered = sorted(state["state"].items(), key=lambda item: index[item[0]])
    return {"state": {index[name]: value for name, value in ordered},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`by_index`: a plain optimizer's ``state_dict()`` keyed by parameter names."""
    count = sum(len(group["params"]) for group in state["param_groups"])
    if count != len(names):
        raise PhalanxError(f"checkpoint's optimizer holds {count} parameters but this model has {len(names)}; resume "
                           "with the --model the checkpoint was trained with")
    return {"state": {names[int(i)]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                             for group in state["param_groups"]]}
