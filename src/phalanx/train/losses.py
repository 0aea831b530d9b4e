"""The per-step losses, kept on the device until the loop looks at them.

Reading a loss on the host waits for the device to finish the step, and agreeing on it across
ranks is a collective: on every step, that is a stall the user's own loop would not have. So
each step keeps its loss (a device tensor, no synchronisation: a list append, where copying it into a
preallocated tensor cost some microseconds a step), and the loop looks
only when it logs, checkpoints or the window is full: one host read and one small all-reduce for
all the steps since it last looked. The NaN guard stays exact: every step's agreed loss is
checked, and the first non-finite one is named with its own step.
"""

from __future__ import annotations

from typing import Callable

import torch

#: Most steps between two looks (a look is also forced at every log and checkpoint step).
MAX_WINDOW = 1000


class LossWindow:
    def __init__(self, device: torch.device, capacity: int):
        self.device = device
        self.capacity = max(1, min(capacity, MAX_WINDOW))
        self.steps: list[int] = []  #: the global step of each value held
        self.values: list[torch.Tensor] = []  #: each step's loss, as the step left it on the device

    def add(self, step: int, loss: torch.Tensor) -> None:
        # (a runtime's loss comes detached: a second detach is a dispatched op, 1-3.5 us a step for nothing)
        self.values.append(loss.detach() if loss.requires_grad else loss)
        self.steps.append(step)

    @property
    def full(self) -> bool:
        return len(self.steps) == self.capacity

    def __len__(self) -> int:
        return len(self.steps)

    def drain(self, agree: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[int], list[float]]:
        """Every held step and its loss as the ranks agree on it (``agree``: the runtime's
        ``global_losses``); the window is empty afterwards."""
        steps, values, self.steps, self.values = self.steps, self.values, [], []
        try:  # one stack, one cast: a reshape and a cast of each value took 6 us a step (benchmarks/README.md)
            losses = torch.stack(values).reshape(len(values)).to(self.device, torch.float32)
        except RuntimeError:  # losses on other devices (a pipeline's last stage), or of other shapes
            losses = torch.stack([v.reshape(()).to(self.device, torch.float32) for v in values])
        return steps, agree(losses).tolist()
