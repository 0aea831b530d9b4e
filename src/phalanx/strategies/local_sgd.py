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

from ..costs import LocalSGDCost
from ..simulate import LOCAL_SGD
from ..options import option
from ..errors import PhalanxError
from .base import Build, Options, Runtime
from .registry import register
from .replicas import verify_replicas


@dataclasses.dataclass(frozen=True)
class LocalSGD(Options):
    name: ClassVar[str] = "local-sgd"
    summary: ClassVar[str] = "local steps, parameters averaged every H steps; torch's PeriodicModelAverager"

    sync_every: int = option(8, "average the parameters every H optimizer steps")

    def __post_init__(self) -> None:
        if not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise PhalanxError(f"--sync-every must be at least 1 step, got {self.sync_every!r}")

    def describe(self) -> str:
        return f"local-sgd (parameters averaged every {self.sync_every} steps)"

    def runtime(self, build: Build) -> Runtime:
        return LocalSGDRuntime(build, self)


# Its cost model, for phalanx estimate (costs/local_sgd.py); its simulated rule, for compare --simulate (simulate/periodic.py).
register(LocalSGD, cost=LocalSGDCost(), simulated=LOCAL_SGD)


class LocalSGDRuntime(Runtime):
    def __init__(self, build: Build, options: LocalSGD):
        super().__init__(build, description=options.describe())
        if self.ctx.distributed:
            verify_replicas(self.model, self.ctx)
            averager = PeriodicModelAverager(period=options.sync_every, warmup_steps=0)
            params = list(self.model.parameters())
            # The optimizer stays the user's object; its step() now ends with the averager's turn.
            self.optimizer.register_step_post_hook(lambda *_: averager.average_parameters(params))

    def global_losses(self, losses: torch.Tensor) -> torch.Tensor:
        # No collective: that would put the workers back in lockstep at every log step.
        return losses
