"""Parameters as one flat vector and back: what a version stores and what a gradient is."""

from __future__ import annotations

from typing import Optional

import torch


def flat_of(params) -> torch.Tensor:
    """The parameters as one flat vector (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in params])


def set_grads(params, flat_grad: torch.Tensor) -> None:
    """Give each parameter its slice of ``flat_grad`` (as the parameter server does)."""
    offset = 0
    for p in params:
        p.grad = flat_grad[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


class Stepped:
    """The parameters one optimizer steps (the common ones of sync, a server's), and their flat vector.

    Where the optimizer is element-wise (the built-in SGD, Adam and AdamW: each element's update reads
    only its own state), the model's tensors become one flat tensor and the optimizer steps that: the
    same numbers, one pass instead of one per tensor, and a version is one copy. A user's optimizer
    may treat tensors apart (per-layer norms, groups by name): it gets the model's own tensors.
    """

    def __init__(self, model, elementwise: bool):
        #: the module whose own tensors are stepped (a factory that takes the model gets it)
        self.model: Optional[torch.nn.Module] = None
        if elementwise:
            self.flat: Optional[torch.Tensor] = flat_of(model.parameters()).requires_grad_(True)
            self.tensors = [self.flat]
        else:
            self.flat, self.model = None, model
            self.tensors = list(model.parameters())

    def vector(self) -> torch.Tensor:
        """The parameters now, flat (shares memory with them where they are flat: read, do not keep)."""
        return self.flat.detach() if self.flat is not None else flat_of(self.tensors)

    def snapshot(self) -> torch.Tensor:
        """A copy of the parameters now, to keep (a version)."""
        return self.flat.detach().clone() if self.flat is not None else flat_of(self.tensors)

    def set_grad(self, grad: torch.Tensor) -> None:
        if self.flat is not None:
            self.flat.grad = grad
        else:
            set_grads(self.tensors, grad)
