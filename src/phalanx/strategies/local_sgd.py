"""Local SGD: every worker steps on its own; parameters are averaged every H steps.

Communication: none between averagings; every ``sync_every`` optimizer steps, torch's
``PeriodicModelAverager`` all-reduces the parameters (a mean over workers). Optimizer state
(momentum) stays local to each worker and is not averaged, as in the usual post-local SGD.
With ``sync_every=1`` and plain SGD this computes exactly what ``sync`` computes.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from ..errors import PhalanxError
from .base import Strategy
from .sync import verify_replicas


@dataclasses.dataclass
class LocalSGD(Strategy):
    name: ClassVar[str] = "local-sgd"
    #: average the parameters every this many optimizer steps
    sync_every: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sync_every < 1:
            raise PhalanxError(f"--sync-every must be at least 1 step, got {self.sync_every}")

    def describe(self) -> str:
        return f"local-sgd (parameters averaged every {self.sync_every} steps)"

    def setup(self, ctx, model, make_optimizer):
        model, optimizer = super().setup(ctx, model, make_optimizer)
        if ctx.distributed:
            verify_replicas(model, ctx)
            averager = PeriodicModelAverager(period=self.sync_every, warmup_steps=0)
            params = list(model.parameters())
            # The optimizer stays the user's object; its step() now ends with the averager's turn.
            optimizer.register_step_post_hook(lambda *_: averager.average_parameters(params))
        return model, optimizer

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # No per-step collective: that would put the workers back in lockstep every step.
        return loss
