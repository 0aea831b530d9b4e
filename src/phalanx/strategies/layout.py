"""The layout of a job (the parent's side of a strategy): pure, computed before any process starts.

From a :class:`Job` (the devices, the batch, the model), a strategy's :meth:`~phalanx.strategies.options.Options.layout`
says how many processes, each rank's role, which data shard it reads, which ranks the job may lose, the
device order, and how the ranks agree to stop. Every check that can be made without processes is made here,
so bad input never reaches a worker.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Optional, Union, overload

import torch
from torch import nn

from ..kinds import Kind


@dataclasses.dataclass(frozen=True)
class Job:
    """What a layout is computed from, in the parent (no processes, nothing measured)."""

    devices: tuple[torch.device, ...]  #: one per worker the user asked for
    batch_size: Optional[int] = None  #: examples per data shard per step (None: not known yet)
    accumulate: int = 1  #: micro-batches per step
    processes: Optional[int] = None  #: fixed by the launcher (torchrun): the job's world size
    gpu_islands: Optional[tuple[tuple[int, ...], ...]] = None  #: GPU indices grouped by direct links
    model: Optional[nn.Module] = None  #: the model, for strategies that split it

    @property
    def workers(self) -> int:
        return len(self.devices)


class Role(Kind):
    """What one process of the job does."""

    WORKER = "worker"  #: trains on its data shard (a data-parallel replica)
    SERVER = "server"  #: holds the parameters and the optimizer; reads no data (a parameter server)
    STAGE = "stage"  #: runs one slice of the network (a pipeline)


class StopRule(Kind):
    """How the ranks stop early when asked (SIGTERM, SIGINT)."""

    AGREE = "agree"  #: on one step boundary they agree on (ranks in step with each other)
    SERVER = "server"  #: rank 0 decides and tells the others (a parameter server's workers)
    EACH = "each"  #: every rank at its own step (ranks that never wait for each other)


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One process of the job."""

    role: Role  #: what it does (a plain word from a strategy of the user's is converted here)
    label: str  #: how messages name it ("worker 2", "the parameter server (rank 0)")
    shard: Optional[int]  #: which of the layout's data shards it trains on (None: it reads no data)
    evaluates: Optional[tuple[int, int]]  #: (part, parts) of the test set it evaluates (None: none)
    expendable: bool = False  #: the job goes on if this process dies

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role.of(self.role, "a rank's role"))


class Ranks(Sequence[RankPlan]):
    """A layout's ranks made by a rule, each when it is read (``make(r)``): a layout of a million workers, which
    an estimate asks about, costs nothing to make rather than seconds. Equal to the tuple of its ranks."""

    def __init__(self, size: int, make: Callable[[int], RankPlan]):
        self.size, self.make = size, make  # (``make`` pickles, as a Layout is sent to every worker)

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> RankPlan: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[RankPlan, ...]: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[RankPlan, tuple[RankPlan, ...]]:
        if isinstance(index, slice):
            return tuple(map(self.make, range(*index.indices(self.size))))
        r = operator.index(index)
        r = r + self.size if r < 0 else r
        if not 0 <= r < self.size:
            raise IndexError(f"rank {index} of {self.size}")
        return self.make(r)

    def __iter__(self) -> Iterator[RankPlan]:
        return map(self.make, range(self.size))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Sequence) and len(other) == self.size
                and all(map(operator.eq, self, other)))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Ranks({self.size}, {self.make!r})"


def worker(group: int, groups: int, r: int) -> RankPlan:
    """Rank r as a worker of data group r // ``group`` of ``groups``: it reads that shard and evaluates that part."""
    return RankPlan(Role.WORKER, f"worker {r}", r // group, (r // group, groups))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every process of the job, decided in the parent."""

    ranks: Sequence[RankPlan]  #: a tuple, or :class:`Ranks` made by a rule
    devices: tuple[torch.device, ...]  #: one per rank, in rank order (on this machine)
    shards: int  #: data shards per global step: the global batch is batch size x shards
    lockstep: bool  #: every rank takes every global step together (collectives are safe)
    islands: Optional[tuple[tuple[int, ...], ...]] = None  #: ranks grouped by direct links (topology)
    #: how the ranks stop early when asked (SIGTERM, SIGINT); a plain word is converted here
    stop_rule: StopRule = StopRule.AGREE
    #: under StopRule.AGREE: how many steps one rank may run ahead of another between the collectives that hold
    #: them together (1: every step has one; local SGD and DiLoCo: H, they meet at each averaging)
    drift: int = 1
    #: the rank at one end of every message of the job (a parameter server), whose own bytes on the
    #: wire are the job's; None: no such rank
    hub: Optional[int] = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_rule", StopRule.of(self.stop_rule, "a layout's stop_rule"))

    def label(self, rank: int) -> str:
        return self.ranks[rank].label if 0 <= rank < len(self.ranks) else f"rank {rank}"

    def expendable(self, rank: int) -> bool:
        return 0 <= rank < len(self.ranks) and self.ranks[rank].expendable


def data_parallel(job: Job, lockstep: bool = True) -> Layout:
    """The layout of every data-parallel strategy: rank r is worker r and reads shard r."""
    n = job.processes or job.workers
    return Layout(Ranks(n, functools.partial(worker, 1, n)), tuple(job.devices), n, lockstep)
