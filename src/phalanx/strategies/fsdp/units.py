"""The units ``fully_shard`` makes of a model: its blocks, or the submodules and classes ``--blocks`` names.

Pure, and asked in the parent (the layout refuses a model with nothing to shard before any worker
starts) and in every worker (the runtime shards these units, bottom-up).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ...errors import PhalanxError
from ...task.models import blocks_of_class, describe_blocks, model_units, repeated_blocks


def shard_units(model: nn.Module, names: Optional[tuple[str, ...]] = None) -> list[tuple[str, nn.Module]]:
    """(name, module) of every unit that ``fully_shard`` makes, in the model's order; a clear error if none.

    Only modules that hold parameters are units; parameters outside every unit stay with the root.
    """
    units = named_units(model, names) if names is not None else model_units(model)
    if not units:
        raise PhalanxError(
            f"{type(model).__name__} has no blocks to shard: fsdp shards each block (a submodule holding parameters) "
            "over the workers; make the model an nn.Sequential of blocks, give it submodules, or name them with "
            "FSDP(blocks=...) / --blocks"
        )
    if names is None and _tied(units):  # fully_shard refuses a parameter in two groups
        raise PhalanxError(f"{type(model).__name__}'s blocks ({describe_blocks(units)}) share a parameter (tied "
                           "weights); name blocks that do not with --blocks, leaving the shared one to the root")
    return units


def named_units(model: nn.Module, names: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The units ``--blocks`` names: a submodule by its name in ``named_modules()``, or every (outermost) module
    of a class by the class's name; holding parameters, each once."""
    units: dict[str, nn.Module] = {}
    for name in names:
        try:
            found = [(name, model.get_submodule(name))]
        except AttributeError:
            found = blocks_of_class(model, name)
        if not found:
            raise PhalanxError(f"--blocks names {name!r}, neither a submodule nor a module class of "
                               f"{type(model).__name__} ({_what_it_has(model)}); name submodules as "
                               "model.named_modules() does, or classes as type(module).__name__ does")
        units.update((n, m) for n, m in found if any(True for _ in m.parameters()))
    return list(units.items())


def _what_it_has(model: nn.Module) -> str:
    """``its repeated blocks: Block (transformer.h.0, transformer.h.1); its children: transformer, lm_head``."""
    repeated = repeated_blocks(model)
    classes = sorted({type(m).__name__ for _, m in repeated})
    children = ", ".join(n for n, _ in model.named_children()) or "none"
    blocks = f"its repeated blocks: {', '.join(classes)} ({describe_blocks(repeated, 3)})" if repeated else \
        "no repeated blocks"
    return f"{blocks}; its children: {children}"


def _tied(units: list[tuple[str, nn.Module]]) -> bool:
    """Whether two units hold the same parameter (``fully_shard`` refuses a parameter in two groups)."""
    seen: set[int] = set()
    for _, unit in units:
        mine = {id(p) for p in unit.parameters()}
        if mine & seen:
            return True
        seen |= mine
    return False
