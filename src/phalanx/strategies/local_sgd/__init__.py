"""Local SGD: every worker steps on its own; parameters are averaged every H steps.

Communication: none between averagings; every ``sync_every`` optimizer steps (after steps 1, H+1,
2H+1, ...), torch's ``PeriodicModelAverager`` all-reduces the parameters (a mean over workers), and
the floating buffers (BatchNorm's running statistics) are averaged with them (integer ones, step
counts, taken from rank 0). Optimizer state (momentum) stays local to each worker and is not averaged,
as in the usual post-local SGD. The run ends with a last averaging of whatever steps came after the
previous one, so the model evaluated and saved is the one every rank holds, every step's work in it.
With ``sync_every=1`` and plain SGD this computes exactly what ``sync`` computes.

Checkpoints (on 2+ workers, sharded: ``replica_state.py``): ``model`` is the replicas' average, what is
printed and evaluated; each rank also saves its own replica and optimizer state, so a resume on the same
worker count continues exactly, from any step; a stop (a signal) leaves the last averaging owed.
When a worker dies, the survivors average their replicas over a group of their own
(``launcher/survivors.py``) and one of them saves the average: the lost worker's local steps since the
last averaging are lost with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import torch
from torch.distributed.algorithms.model_averaging import utils as averaging
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from .costs import LocalSGDCost
from .simulated import LOCAL_SGD
from ...options import option
from ...errors import PhalanxError
from ..base import Batch, Build, Runtime, SurvivorState
from ..options import Options
from ..layout import Job, Layout, data_parallel
from .. import replica_state
from ..registry import register
from ..replicas import average_buffers, average_over, verify_replicas


@dataclasses.dataclass(frozen=True)
class LocalSGD(Options):
    name: ClassVar[str] = "local-sgd"
    one_piece_backward: ClassVar[bool] = True
    survivors_save: ClassVar[bool] = True
    checkpoints_activations: ClassVar[bool] = True
    sharded_checkpoints: ClassVar[bool] = True  # each replica's own state, by rank (replica_state.py)
    summary: ClassVar[str] = "local steps, parameters averaged every H steps; torch's PeriodicModelAverager"

    sync_every: int = option(8, "average the parameters every H optimizer steps")

    def __post_init__(self) -> None:
        if not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise PhalanxError(f"--sync-every must be at least 1 step, got {self.sync_every!r}")

    def describe(self) -> str:
        return f"local-sgd (parameters averaged every {self.sync_every} steps)"

    def layout(self, job: Job) -> Layout:
        return dataclasses.replace(data_parallel(job), drift=self.sync_every)  # (ranks meet at each averaging)

    def runtime(self, build: Build) -> Runtime:
        return LocalSGDRuntime(build, self)


# Its cost model, for phalanx estimate (costs.py); its simulated rule, for compare --simulate (simulated.py).
register(LocalSGD, cost=LocalSGDCost(), simulated=LOCAL_SGD)


class LocalSGDRuntime(Runtime):
    def __init__(self, build: Build, options: LocalSGD):
        super().__init__(build, description=options.describe())
        self.params, self.buffers = list(self.model.parameters()), list(self.model.buffers())
        self.since = 0  #: optimizer steps since the last averaging (every rank the same: they step together)
        #: this step's update went in and the loop has not been told: an averaging that fails leaves it so
        self.ahead = False
        if self.ctx.distributed:
            verify_replicas(self.model, self.ctx)
            self.averager = PeriodicModelAverager(period=options.sync_every, warmup_steps=0)
            # The optimizer stays the user's object; its step() now ends with the averager's turn.
            self.optimizer.register_step_post_hook(lambda *_: self._after_step())

    def train_step(self, batch: Batch, y: Optional[torch.Tensor] = None, parts: Optional[int] = None) -> torch.Tensor:
        loss = super().train_step(batch, y, parts)  # (its update ends with the averager's turn: _after_step)
        self.ahead = False
        return loss

    def _after_step(self) -> None:
        self.ahead = True
        # The averager's own rule (no warm-up): it averages when its count of steps is a multiple of H.
        due = self.averager.step % self.averager.period == 0
        self.averager.average_parameters(self.params)
        if due:
            average_buffers(self.buffers)
        self.since = 0 if due else self.since + 1

    def finish(self, stopping: bool = False) -> bool:
        """A last averaging of the steps since the previous one (parameters and buffers): every rank then
        holds the model that is evaluated and saved. Returns whether it averaged (every rank alike). Not on a
        stop: the checkpoint holds every replica as it is (and their average as its model)."""
        super().finish()
        if not self.ctx.distributed or not self.since or stopping:
            return False
        # torch's own averaging, without the averager's filter: after the step no parameter has a gradient.
        averaging.average_parameters(iter(self.params), self.averager.process_group)
        average_buffers(self.buffers)
        self.since = 0
        return True

    def survivor_state(self, step: int, survivors: Any) -> SurvivorState:
        """The survivors' replicas averaged over a group of their own (parameters and buffers, as an averaging
        does): the lost replica's local steps since the last averaging are lost with it. This rank's optimizer
        state is saved with it, as at any checkpoint."""
        held = step + int(self.ahead)  # (an averaging that failed came after this step's update)
        group = survivors.group()
        average_over(self.params + self.buffers, group)
        kept = "its own replica" if group is None else "the survivors' replicas averaged"
        # (the base's state: this rank's own, no collective, whatever a checkpoint of the whole job holds)
        return SurvivorState(held, Runtime.own_state(self), f"{kept}; the lost worker's local steps since the last "
                                                             "averaging are lost with it")

    def global_losses(self, losses: torch.Tensor) -> torch.Tensor:
        # No collective: that would put the workers back in lockstep at every log step.
        return losses

    # ---- checkpoints ----
    @property
    def writes_shards(self) -> bool:
        return self.ctx.distributed  # every replica's own state, each rank's in its own file

    def shard_state_dict(self) -> dict[str, Any]:
        """The replicas' average as the model (this replica's own where they are equal: just averaged), and
        this rank's replica and optimizer state (see ``replica_state.py``). A collective."""
        model = replica_state.averaged(self.module) if self.since else self.module.state_dict()
        return replica_state.shards(self.ctx, model, self.module, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's own replica where the checkpoint holds one for this worker count, else the average; the
        averaging schedule goes on from the checkpoint's step (after steps 1, H+1, 2H+1, ...)."""
        whole, own, note = replica_state.read(state, self.ctx, LocalSGD.name, self.module, self.optimizer)
        super().load_state_dict(own or whole)
        self.notes += [note] if note else []
        step = int(state.get("step", 0))
        if self.ctx.distributed:
            self.averager.step = step  # (its count of steps decides which steps average)
        # The replicas differ by the steps since the last averaging; started from their average, by none.
        self.since = (step - 1) % self.averager.period if own is not None and step else 0
