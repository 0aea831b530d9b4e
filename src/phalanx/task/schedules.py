"""Learning-rate schedules as pure functions of the global step.

A schedule is a small callable dataclass giving the multiplier of the peak learning rate at a
step; it drives ``torch.optim.lr_scheduler.LambdaLR``. Being a pure function of the step is
what makes resume exact: the step alone restores it.
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import PhalanxError

SCHEDULES = ("constant", "exponential", "cosine")


@dataclasses.dataclass(frozen=True)
class Schedule:
    kind: str = "constant"
    #: exponential: multiply by decay_factor every decay_every steps
    decay_every: int = 100
    decay_factor: float = 0.5
    #: exponential: decay in whole steps of decay_every (True) or smoothly (False)
    staircase: bool = False
    #: ramp linearly from lr/warmup_steps to the peak over this many steps
    warmup_steps: int = 0
    #: cosine: the step at which the rate reaches zero
    total_steps: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise PhalanxError(f"unknown learning-rate schedule {self.kind!r}: choose one of {', '.join(SCHEDULES)}")
        if self.decay_every < 1:
            raise PhalanxError(f"--lr-decay-every must be at least 1 step, got {self.decay_every}")
        if not 0 < self.decay_factor <= 1:
            raise PhalanxError(f"--lr-decay-factor must be in (0, 1], got {self.decay_factor}")
        if self.warmup_steps < 0:
            raise PhalanxError(f"--warmup-steps must be 0 or more, got {self.warmup_steps}")
        if self.total_steps < 1:
            raise PhalanxError(f"total steps must be at least 1, got {self.total_steps}")

    @property
    def constant(self) -> bool:
        """Whether the multiplier is 1 at every step: nothing to step (a LambdaLR's step costs microseconds)."""
        return self.kind == "constant" and not self.warmup_steps

    def __call__(self, step: int) -> float:
        warm = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        if self.kind == "exponential":
            exponent = step / self.decay_every
            return warm * self.decay_factor ** (math.floor(exponent) if self.staircase else exponent)
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, max(0, step - self.warmup_steps) / span)
            return warm * 0.5 * (1.0 + math.cos(math.pi * progress))
        return warm


def scaled_lr(lr: float, global_batch: int, base_batch: int | None) -> float:
    """The linear scaling rule (Goyal et al.): lr grows with the global batch over ``base_batch``."""
    if base_batch is None:
        return lr
    if base_batch < 1:
        raise PhalanxError(f"--lr-base-batch must be at least 1, got {base_batch}")
    return lr * global_batch / base_batch
