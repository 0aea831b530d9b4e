"""What one rank holds: the bytes of its parameters, gradients and optimizer state.

The training loop asks this of every strategy's runtime the same way (its ``module`` and its
``optimizer``), so the figures compare across strategies: ``sync`` holds a whole replica on every
rank, ``fsdp`` about 1/W of one (its parameters, gradients and optimizer state are
:class:`~torch.distributed.tensor.DTensor` s of which a rank holds only its local shard), a
pipeline stage the share of its blocks.

What is counted, per rank:

- **parameters**: every parameter of the module, its local shard where it is sharded;
- **gradients**: one gradient per trainable parameter, sized as the gradient the rank holds now
  (its local shard) or, between steps when gradients are freed (``zero_grad(set_to_none=True)``),
  as the parameter's local shard: what a step holds between backward and the optimizer's update;
- **optimizer**: every tensor in the optimizer's state (momentum, Adam's two moments and step).

Not counted: buffers, activations, and what an engine holds for a moment or for itself (DDP's
gradient buckets, about one more set of gradients; FSDP's all-gathered block during its forward
and backward). Pure: no communication; :func:`largest` takes the element-wise max over ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Held:
    """Bytes one rank holds."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of the part of ``t`` this rank stores (a DTensor's local shard; a plain tensor whole)."""
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor, without importing it on every path
    return local.numel() * local.element_size()


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def held(module: nn.Module, optimizer: torch.optim.Optimizer) -> Held:
    """The bytes of parameters, gradients and optimizer state this rank holds (see the module docstring)."""
    params = list(module.parameters())  # each shared parameter once
    parameters = sum(local_bytes(p) for p in params)
    gradients = sum(local_bytes(p.grad if p.grad is not None else p) for p in params if p.requires_grad)
    optimizer_bytes = sum(local_bytes(t) for state in optimizer.state.values() for t in _tensors(state))
    return Held(parameters, gradients, optimizer_bytes)


def largest(figures: Iterable[Held]) -> Held:
    """Element-wise max over ranks (the rank that needs the most memory sets a device's size)."""
    figures = list(figures)
    return Held(*(max(getattr(f, k) for f in figures) for k in ("parameters", "gradients", "optimizer")))


def size(n: int) -> str:
    """Bytes for people: 1.3 kB, 0.60 MB, 2.41 GB."""
    if n < 1_000_000:
        return f"{n / 1e3:.1f} kB"
    return f"{n / 1e6:.2f} MB" if n < 1_000_000_000 else f"{n / 1e9:.2f} GB"


def describe(mine: Held, most: Held | None = None) -> list[str]:
    """Summary lines: rank 0's figures, and the max of each over the ranks where it differs."""
    def parts(h: Held) -> str:
        return (f"parameters {size(h.parameters)}, gradients {size(h.gradients)}, optimizer state "
                f"{size(h.optimizer)} (total {size(h.total)})")

    lines = [f"memory per rank: {parts(mine)} on rank 0"]
    if most is not None and most != mine:
        lines.append(f"  max over ranks: {parts(most)}")
    return lines
