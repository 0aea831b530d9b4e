"""The parameter-server family: ``ps`` (asynchronous), ``ssp`` (bounded staleness), ``backup``.

Layout: rank 0 is the server and owns the parameters and the optimizer; ranks 1..W are the
workers (``--workers W`` counts workers, so W + 1 processes run; the server shares the first
worker's device). Worker r reads data shard r - 1, as ``sync``'s worker r - 1 would; the server
reads no data and evaluates the whole test set. A worker may die and the job goes on; the
server may not.

- ``protocol.py``: the messages (HELLO, PUSH, REPLY, BYE) over point-to-point;
- ``gate.py``: the SSP rule, pure logic; ``aggregate.py``: which gradients make an update, pure logic;
- ``server.py``: rank 0's loop; ``worker.py``: ranks 1..W.

Each strategy is a gate and an aggregation rule:

- ``ps``: no gate; each gradient applied as it arrives (scaled by 1/W).
- ``ssp`` (K): a worker may begin its step c only while c minus the slowest live worker's clock is
  at most K; otherwise the server holds its reply. With K = 0 the rule is also rounds with no
  backup: every live worker's gradient of the step averaged into one update, exactly what
  ``sync`` computes.
- ``backup`` (B): no gate; rounds: each update averages the first W − B gradients computed on the
  current parameters, and the late ones are dropped (Chen et al., 2016). B = 0 is ``sync``.

Models with buffers (BatchNorm) work in all three: the buffers travel with the gradients and the
replies, and the server keeps one set (see ``server.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterable, Optional

import torch

from .costs import ParameterServerCost
from .simulated import SERVER as SIMULATED_SERVER
from ...errors import PhalanxError
from ...options import option
from ...launcher.watch import has_raised, launcher_view, say_gone
from ...task.metrics import Totals, add_up
from ..base import COUNT_CORRECT, Batch, Build, Report, Runtime
from ..options import Options
from ..layout import Job, Layout, RankPlan, Ranks, Role, StopRule
from ..registry import register
from ..sync import Sync
from .aggregate import Asynchronous, Rounds, Rule
from .protocol import SERVER
from .server import Server
from .worker import WorkerRuntime


def rank_plan(r: int) -> RankPlan:
    """Rank 0 is the server; rank r > 0 is worker r, which reads shard r - 1 and may die with the job going on."""
    if r == 0:
        return RankPlan(Role.SERVER, "the parameter server (rank 0)", None, (0, 1))
    return RankPlan(Role.WORKER, f"worker {r}", r - 1, None, expendable=True)


@dataclasses.dataclass(frozen=True)
class ParameterServer(Options):
    """Asynchronous parameter server: rank 0 serves, ranks 1..W train."""

    name: ClassVar[str] = "ps"
    one_piece_backward: ClassVar[bool] = True
    summary: ClassVar[str] = ("asynchronous parameter server: workers push gradients and pull parameters without "
                              "waiting for each other")

    @property
    def bound(self) -> Optional[int]:
        """The SSP gate's bound in steps (None: no gate)."""
        return None

    def aggregation(self, workers: int) -> Rule:
        """Which gradients make one update (``aggregate.py``)."""
        return Asynchronous(workers)

    def layout(self, job: Job) -> Layout:
        processes = job.processes or job.workers + 1
        workers = processes - 1
        if workers < 2:
            raise PhalanxError(
                f"--strategy {self.name} needs at least 2 workers (it runs one more process, the server): with "
                f"{workers} worker there is no one to wait for or to run ahead of; use --workers 2 or more, or "
                "--strategy sync"
            )
        # The server shares the first worker's device: it holds one copy of the model and applies updates.
        return Layout(Ranks(processes, rank_plan), (job.devices[0],) + tuple(job.devices), workers, lockstep=False,
                      stop_rule=StopRule.SERVER, hub=SERVER)

    def describe(self) -> str:
        return "ps (asynchronous parameter server)"

    def runtime(self, build: Build) -> Runtime:
        if build.plan.role is Role.SERVER:
            return ServerRuntime(build, self)
        return WorkerRuntime(build, self.describe())


@dataclasses.dataclass(frozen=True)
class SSP(ParameterServer):
    """Stale-synchronous parallel: a worker may run at most ``staleness`` steps ahead of the slowest."""

    name: ClassVar[str] = "ssp"
    summary: ClassVar[str] = "bounded staleness: a worker runs at most K steps ahead of the slowest (K = 0 is sync)"

    staleness: int = option(4, "steps a worker may run ahead of the slowest live worker (0: synchronous)")

    def __post_init__(self) -> None:
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise PhalanxError(f"--staleness must be 0 or more steps (0 is synchronous), got {self.staleness!r}")

    @property
    def bound(self) -> Optional[int]:
        return self.staleness

    def aggregation(self, workers: int) -> Rule:
        return Rounds(workers, 0) if self.staleness == 0 else Asynchronous(workers)

    def describe(self) -> str:
        return f"ssp (parameter server, staleness bound {self.staleness} step{'s' * (self.staleness != 1)})"


@dataclasses.dataclass(frozen=True)
class Backup(ParameterServer):
    """Synchronous with backup workers: each update averages the first W − B fresh gradients, late ones dropped."""

    name: ClassVar[str] = "backup"
    summary: ClassVar[str] = ("synchronous with backup workers: each update averages the first W - B gradients, the "
                              "late ones are dropped (B = 0 is sync)")

    backup_workers: int = option(1, "workers each update does not wait for: it averages the first W - B gradients "
                                    "computed on the current parameters and drops the late ones")

    def __post_init__(self) -> None:
        if not isinstance(self.backup_workers, int) or isinstance(self.backup_workers, bool) or \
                self.backup_workers < 0:
            raise PhalanxError(f"--backup-workers must be 0 or more (0 is sync), got {self.backup_workers!r}")

    def layout(self, job: Job) -> Layout:
        layout = super().layout(job)
        workers, backup = layout.shards, self.backup_workers
        if backup >= workers:
            raise PhalanxError(
                f"--backup-workers {backup} leaves no gradient to average: each update takes the first W - B = "
                f"{workers} - {backup} = {workers - backup} of {workers} workers' gradients; use --backup-workers "
                f"{workers - 1} or fewer, or --workers {backup + 1} or more"
            )
        return layout

    def aggregation(self, workers: int) -> Rule:
        return Rounds(workers, self.backup_workers)

    def describe(self) -> str:
        b = self.backup_workers
        return f"backup (parameter server, synchronous with {b} backup worker{'s' * (b != 1)})"


# ps: its cost model, for phalanx estimate (strategies/ps/costs.py; the advice compares it with sync).
# ssp and backup have none yet: the registry is keyed by the exact class, so they do not inherit this one.
# One simulated rule for the family (strategies/ps/simulated.py): each asks its options for its gate and aggregation.
register(ParameterServer, cost=ParameterServerCost(instead=Sync), simulated=SIMULATED_SERVER)
register(SSP, simulated=SIMULATED_SERVER)
register(Backup, simulated=SIMULATED_SERVER)


def momentum_note(optimizer: torch.optim.Optimizer, workers: int) -> list[str]:
    """A header line where SGD momentum meets stale gradients. Asynchrony alone acts as a momentum of
    about 1 - 1/W (Mitliagkas et al., 2016, "Asynchrony begets momentum"); on top of an explicit 0.9
    the sum can pass 1 and the loss climb (seen with digits: benchmarks/README.md, "Figures behind the
    code"). Said, not changed: the user's setting stands."""
    momentum = max((group.get("momentum") or 0.0) for group in optimizer.param_groups)
    if momentum < 0.5:
        return []
    return [f"sgd momentum {momentum:g} on stale gradients: asynchrony with {workers} workers adds a momentum of "
            f"about 1 - 1/{workers} of its own (Mitliagkas et al., 2016); if the loss climbs, lower --momentum "
            "(0 works: the asynchrony supplies the momentum)"]


class ServerRuntime(Runtime):
    """Rank 0: each of its 'steps' is serving until W more gradients are applied."""

    def __init__(self, build: Build, options: ParameterServer):
        super().__init__(build, description=options.describe())
        workers = self.ctx.world_size - 1
        rule = options.aggregation(workers)
        store = self.ctx.store
        jobs = launcher_view(store)  # where the launcher looks for who is gone
        clip = self.clip_gradients if build.clip_grad_norm is not None else None  # the update's gradient, here
        self.server = Server(self.model, self.optimizer, self.ctx.world_size, self.ctx.device, options.bound,
                             rule, build.steps, build.hang_timeout_s, raised=lambda worker: has_raised(store, worker),
                             clip=clip, gone=lambda worker: say_gone(jobs, worker))
        self.notes += [] if rule.drops_late else momentum_note(self.optimizer, workers)
        self.told_diverged = False

    def train_step(self, batch: Batch = None, y: Optional[torch.Tensor] = None, parts: Optional[int] = None
                   ) -> torch.Tensor:
        return self.server.serve_one_step()  # (it reads no data)

    def next_step(self, step: int) -> Optional[int]:
        # After a non-finite loss: first the step it belongs to (the loop holds its loss and looks),
        # then stop, so the loop's NaN guard names that step and the last checkpoint.
        if self.server.diverged is None:
            return self.server.global_step()
        if self.told_diverged:
            return None
        self.told_diverged = True
        return self.server.diverged_step

    def nonfinite_inputs(self, step: int) -> Optional[str]:
        bad = self.server.diverged
        if bad is None or not bad.inputs or step != self.server.diverged_step:
            return None
        return f"{bad.inputs} (worker {bad.worker}'s batch)"

    def global_losses(self, losses: torch.Tensor) -> torch.Tensor:
        return losses  # the server heard every worker's loss: it alone guards against divergence

    def arrive_for_evaluation(self) -> None:
        pass  # the server evaluates alone

    def evaluate(self, batches: Iterable[Batch], totals: Totals = COUNT_CORRECT) -> tuple[float, ...]:
        # the whole set, no collective
        return tuple(add_up(self.module, batches, self.ctx.device, totals, self.build.step).tolist())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.server.start_at(int(state["step"]))

    def finish(self, stopping: bool = False) -> bool:
        # The gradients still in flight are applied (or counted as dropped) here, after the last step:
        # a checkpoint of this step written in the loop no longer holds the model; the final one does.
        return self.server.drain()

    def report(self, final: bool = False) -> Report:
        extra = [self.server.dropped_line()] + ([self.server.in_flight_line()] if final else [])
        return Report(self.server.stats(final),
                      [self.server.staleness.line(lead=self.server.max_lead)] + [line for line in extra if line])

    def close(self) -> None:
        self.server.close()


__all__ = ["Backup", "ParameterServer", "SSP"]
