"""Activation checkpointing (``--activation-checkpointing``): each block keeps only its input for backward
and runs its forward again there, trading about one more forward per step for the activations inside it.

The blocks are the strategy's own (``Options.units``: fsdp's units, the model's repeated blocks for the
others), each given torch's composable ``checkpoint`` (non-reentrant ``torch.utils.checkpoint``, the
engine of ``checkpoint_wrapper``) in place, before any strategy wraps the model, as torchtitan orders it.
Not ``checkpoint_wrapper`` itself: it puts a module around each block, which renames every parameter in
it (``_checkpoint_wrapped_module.``), and the names are what fsdp numbers its optimizer state by and what
``--blocks`` and a user's optimizer factory see; the composable form keeps the model as written.

What it saves is measured once, on rank 0, by counting what autograd keeps for backward in one forward
of the first batch (``saved_tensors_hooks``: each distinct storage once, parameters not counted, and a
checkpointed block's input, which the recomputation holds), without and with: CPU memory statistics do
not exist, and on a GPU the same count is what a step's peak grows by.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn

from .task.models import describe_blocks


@dataclasses.dataclass(frozen=True)
class Recomputed:
    """What ``--activation-checkpointing`` did: the blocks, and the bytes kept for backward (rank 0 measures)."""

    blocks: str  #: the blocks, as the plan line names them
    count: int
    saved_without: Optional[int] = None  #: bytes autograd keeps for backward in one forward, plain
    saved_with: Optional[int] = None  #: the same with every block checkpointed
    unmeasured: str = ""  #: why nothing was measured, where the line should say so

    def line(self) -> str:
        measured = ""
        if self.saved_without is not None and self.saved_with is not None:
            measured = (f"; kept for backward in one forward of this rank's batch: {_mb(self.saved_without)} -> "
                        f"{_mb(self.saved_with)} ({self.saved_with / max(self.saved_without, 1):.2f}x)")
        elif self.saved_with is not None:  # the plain forward did not fit: what checkpointing is for
            measured = (f"; kept for backward in one forward of this rank's batch: {_mb(self.saved_with)} (without "
                        "checkpointing the forward did not fit the device)")
        elif self.unmeasured:
            measured = f" (what it saves not measured: {self.unmeasured})"
        return (f"activation checkpointing: {self.count} blocks ({self.blocks}) keep only their input and run "
                f"their forward again in backward{measured}")

    def fields(self) -> dict[str, Any]:
        return {"blocks": self.count, "saved_bytes_without": self.saved_without, "saved_bytes_with": self.saved_with}


def checkpoint_blocks(model: nn.Module, units: list[tuple[str, nn.Module]],
                      measure: Optional[Callable[[], Any]] = None, unmeasured: str = "") -> Recomputed:
    """Checkpoint every unit of ``model`` in place; ``measure``: one forward of a batch (and its loss), run before
    and after to count what is kept for backward. The model's state (buffers, random generators) is as before."""
    from torch.distributed._composable import checkpoint

    modules = [module for _, module in units]
    without = None
    if measure is not None:
        try:
            without = saved_bytes(model, modules, measure)
        except torch.OutOfMemoryError:  # the run asked for checkpointing because this does not fit: go on with it
            pass
    for module in modules:
        checkpoint(module)  # non-reentrant: hooks around the block's forward, the model's names unchanged
    with_ = saved_bytes(model, modules, measure) if measure is not None else None
    return Recomputed(describe_blocks(units), len(units), without, with_, unmeasured)


def saved_bytes(model: nn.Module, blocks: list[nn.Module], forward: Callable[[], Any]) -> int:
    """Bytes autograd keeps for backward in one ``forward()``: every distinct storage it saves, and the inputs of
    ``blocks`` (a checkpointed block holds its input to run again), parameters not counted. Nothing changes:
    the random generators are forked, the buffers (BatchNorm's running statistics) put back."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t: Any) -> None:
        if torch.is_tensor(t) and t.layout == torch.strided:
            storage = t.untyped_storage()
            if storage.data_ptr() not in parameters:
                kept[storage.data_ptr()] = storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    def inputs(module: nn.Module, args: tuple) -> None:
        for a in args:
            keep(a)

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    hooks = [block.register_forward_pre_hook(inputs) for block in blocks]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.enable_grad():
            forward()
    finally:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    return sum(kept.values())


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


__all__ = ["Recomputed", "checkpoint_blocks", "saved_bytes"]
