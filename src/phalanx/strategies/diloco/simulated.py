"""DiLoCo simulated: local SGD's periodic rule, whose meeting is an outer round per fragment (see
``local_sgd/simulated.py``)."""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Any

import torch

from ..local_sgd.simulated import Averaging, Periodic
from .outer import dequantize_int8, due, fragment_bounds, fragment_offsets, quantize_int8

if TYPE_CHECKING:
    from ...simulate.world import World


class OuterRounds(Averaging):
    """DiLoCo's meeting: the averaged pseudo-gradient through the outer optimizer, fragment by fragment."""

    def __init__(self, options: Any, stacks: list[torch.Tensor]):
        super().__init__(options, stacks)
        self.options = options
        self.fragments = fragment_bounds([s[0].numel() for s in stacks], options.fragments)
        self.offsets = fragment_offsets(options.sync_every, options.fragments)
        self.rounds_per_cycle = options.fragments
        self.globals = [s.detach()[0].clone() for s in stacks]
        self.outer = torch.optim.SGD(self.globals, lr=options.outer_lr, momentum=options.outer_momentum,
                                     nesterov=options.outer_momentum > 0)

    def after(self, index: int, last: bool) -> bool:
        fragments = range(len(self.fragments)) if last else due(index, self.every, self.offsets)
        indices = [i for f in fragments for i in range(*self.fragments[f])]
        if not indices:
            return False
        with torch.no_grad():
            for i in indices:
                pseudo = self.globals[i].unsqueeze(0) - self.stacks[i]  # (W, ...): every worker's
                self.globals[i].grad = _mean_on_the_wire(pseudo, self.options.outer_precision)
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
            for i in indices:
                self.stacks[i].copy_(self.globals[i].unsqueeze(0).expand_as(self.stacks[i]))
        return True

    def evaluate(self, world: "World") -> dict[str, float]:
        return world.evaluate(self.model_flat())  # the global model, which every rank evaluates

    def model_flat(self) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for g in self.globals])


def _mean_on_the_wire(pseudo: torch.Tensor, precision: str) -> torch.Tensor:
    """The mean over workers (dim 0) as ``strategies/diloco.average`` reduces it in each precision."""
    W = pseudo.shape[0]
    if precision == "bf16":  # each divided by W and cast, summed in bf16
        parts = (pseudo / W).to(torch.bfloat16)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total.float()
    if precision == "int8":  # each quantized with its own max-abs scale, summed in fp32
        return functools.reduce(operator.add, (dequantize_int8(*quantize_int8(p)) for p in pseudo)) / W
    return pseudo.sum(0) / W


class DiLoCoRule(Periodic):
    def meeting(self, options, world, stacks):
        return OuterRounds(options, stacks)


DILOCO = DiLoCoRule()
