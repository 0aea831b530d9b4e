"""Parameters as one flat vector and back: what a version stores and what a gradient is."""

from __future__ import annotations

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
