"""What the cost model is computed from: a worker's measured step, the model's sizes, the network.

Plain frozen dataclasses, filled by ``estimate/profile.py`` from measurements (or by hand in the
tests), so that every formula in this package is a pure function of them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from .link import Link, ring_terms


@dataclasses.dataclass(frozen=True)
class Compute:
    """One worker's step on this machine, measured under the conditions it would run in.

    "Conditions" are how many worker processes share the node and how many torch threads each
    has: on a CPU node, two workers with one thread each are each slower than one worker alone
    with both cores, and that contention is part of what is measured.
    """

    forward: float  #: seconds, mean over steps
    backward: float
    optimizer: float  #: optimizer.step() + zero_grad()
    loop: float  #: the rest of a training-loop iteration: next batch, learning-rate schedule, loss to a float
    slowest: float  #: mean over steps of the slowest local worker's whole iteration (the pace of lockstep)
    cpu: float  #: CPU-seconds one worker process uses per iteration (every thread)
    processes: int  #: worker processes on the node while measuring
    threads: int  #: torch threads per worker
    cores: Optional[int]  #: the node's cores when workers compute on the CPU; None on GPUs
    block_seconds: tuple[float, ...]  #: forward+backward seconds per block at the per-worker batch
    #: per micro-batch count M: forward+backward seconds per block at a micro-batch of batch/M
    micro_seconds: dict = dataclasses.field(default_factory=dict)
    pack: float = 0.0  #: flatten every gradient into one new vector
    copy: float = 0.0  #: one pass over the gradient bytes into an existing buffer (DDP's buckets)
    unpack: float = 0.0  #: copy one vector back into the parameters
    apply: float = 0.0  #: a parameter server's update for one gradient: scale, copy in, optimizer step, flatten
    #: the first touch of a newly allocated buffer of the parameters' size (page faults), beyond writing it:
    #: a parameter server's messages arrive in fresh buffers
    fresh: float = 0.0
    #: per micro-batch count M: seconds torch.distributed.pipelining's schedule adds per micro-batch and stage
    #: (its own bookkeeping, over running the same micro-batches by hand)
    engine: dict = dataclasses.field(default_factory=dict)
    #: what a step costs beyond its compute and its bytes, measured in these processes (``estimate/overhead.py``):
    #: a DDP step of the model in lockstep (a rank's mean) minus its bare step (each round's slowest rank, mean)
    ddp_excess: float = 0.0
    #: a parameter server's push-to-reply round trip of a 2-parameter model through the real server, its four
    #: messages included
    round_trip_tiny: float = 0.0
    round_trip_spread: float = 0.0  #: the standard deviation of those round trips
    #: an all-reduce of the parameters after :data:`MEETING_AFTER` real steps (gloo's threads idle, as at a periodic
    #: averaging), of the rank that arrived last
    allreduce_params: float = 0.0
    #: at that meeting, the mean wait of the ranks beyond the last arriver's all-reduce: the slowest one's lead
    meeting_wait: float = 0.0
    #: the standard deviation of one worker's step (forward to loop) over every process's timed steps: where it
    #: rivals the mean, something else was loading the machine (``estimate/plausible.py``)
    step_stdev: float = 0.0

    @property
    def step(self) -> float:
        """One worker's iteration with no communication: forward, backward, optimizer, loop."""
        return self.forward + self.backward + self.optimizer + self.loop

    def cpu_share(self, without_optimizer: bool = False) -> float:
        """CPU-seconds per iteration, optionally of the iteration without its optimizer step (a ps worker's)."""
        if not without_optimizer or self.step <= 0:
            return self.cpu
        return self.cpu * (self.step - self.optimizer) / self.step

    def step_spread(self) -> float:
        """The standard deviation of one worker's iteration, read off what was measured: the mean of each
        step's slowest of the ``processes`` workers over the mean step, taken as the expected maximum of that
        many normal draws (0 where one process was measured, or none was slower)."""
        lead = self.slowest - self.step
        if self.processes < 2 or lead <= 0:
            return 0.0
        return lead / expected_max_of_normals(self.processes)

    def block_shares(self) -> list[float]:
        """Each block's share of forward+backward (equal shares when nothing was measured)."""
        total = sum(self.block_seconds)
        n = len(self.block_seconds)
        return [s / total for s in self.block_seconds] if total > 0 else [1.0 / max(n, 1)] * n


def expected_max_of_normals(n: int) -> float:
    """E[max of n independent standard normal draws] (0.564 for 2, 0.846 for 3), by the integral of
    x · n φ(x) Φ(x)^(n−1) over ±8 standard deviations."""
    from statistics import NormalDist

    unit, points = NormalDist(), 1600
    width = 16.0 / points
    total = 0.0
    for i in range(points + 1):
        x = -8.0 + i * width
        total += x * n * unit.pdf(x) * unit.cdf(x) ** (n - 1) * (0.5 if i in (0, points) else 1.0)
    return total * width


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """The model's sizes, read from the model itself (no timing)."""

    block_names: tuple[str, ...]
    block_params: tuple[int, ...]  #: parameters per block, in forward order
    activation_bytes: tuple[int, ...]  #: bytes per example of each block's output
    #: DDP's gradient buckets in the order they are reduced: (bytes, first block holding one of its gradients)
    buckets: tuple[tuple[int, int], ...]
    batch_size: int  #: examples per worker per step
    bytes_per_param: int = 4

    @property
    def params(self) -> int:
        return sum(self.block_params)

    @property
    def param_bytes(self) -> int:
        return self.params * self.bytes_per_param

    def block_bytes(self, block: int) -> int:
        return self.block_params[block] * self.bytes_per_param


@dataclasses.dataclass(frozen=True)
class Network:
    """Where the workers sit: ``per_node`` of them on each machine, machines linked by ``inter``."""

    intra: Link  #: between two workers of one machine
    inter: Link  #: between machines
    per_node: int

    def nodes(self, workers: int) -> int:
        return max(1, math.ceil(workers / self.per_node))

    def link(self, workers: int) -> Link:
        """The link that bounds a ring over ``workers`` ranks placed node by node: the slower one it crosses."""
        return self.intra if self.nodes(workers) == 1 else self.inter


def allreduce(net: Network, ranks: int, nbytes: float, hierarchical: bool = False) -> float:
    """Seconds for an all-reduce of ``nbytes`` over ``ranks`` (flat ring, or phalanx's hierarchical one).

    Hierarchical (``--reduce hierarchical``, see ``phalanx/comm/reduce.py``): reduce within each node
    onto its leader, all-reduce among the leaders, broadcast back within the node. A pipelined
    reduce or broadcast over K ranks costs (K−1)·α + S·β.
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    nodes = net.nodes(ranks)
    if not hierarchical or nodes == 1 or net.per_node == 1:
        messages, moved = ring_terms(ranks, nbytes)
        link = net.link(ranks)
        return messages * link.alpha + moved * link.beta
    local = min(ranks, net.per_node)
    within = 2 * ((local - 1) * net.intra.alpha + nbytes * net.intra.beta)
    messages, moved = ring_terms(nodes, nbytes)
    return within + messages * net.inter.alpha + moved * net.inter.beta


#: steps the workers compute on their own before the meeting the estimate times (``estimate/overhead.py``):
#: local SGD's default period
MEETING_AFTER = 8


def meeting_wait(compute: Compute, steps_apart: float) -> float:
    """Seconds the workers wait, on average, for the slowest one's lead where they meet after ``steps_apart``
    steps on their own (local SGD's averaging, a DiLoCo round). Measured at :data:`MEETING_AFTER` steps
    (``compute.meeting_wait``) and scaled by the root of the steps: the lead is a sum of the steps' independent
    jitter, which grows so (as measured: benchmarks/README.md, "Figures behind the code"). Where nothing was
    measured at a meeting: one step's spread (the slowest worker's step over the mean step), scaled the same
    way."""
    apart = max(steps_apart, 1.0)
    if compute.meeting_wait > 0:
        return compute.meeting_wait * math.sqrt(apart / MEETING_AFTER)
    return max(0.0, compute.slowest - compute.step) * math.sqrt(apart)


TINY_BYTES = 8  #: the gradient of the 2-parameter model a ps round trip is measured with (estimate/overhead.py)


def at_measuring(compute: Compute, net: Network) -> Network:
    """The network of the measuring processes: the K of one node, on its own link."""
    return Network(net.intra, net.intra, compute.processes)


def wake(compute: Compute, facts: ModelFacts, net: Network) -> float:
    """Seconds a collective that follows a stretch of compute pays beyond its messages and bytes: gloo's threads
    have gone idle and must be woken (``compute.allreduce_params``: the parameters' all-reduce after
    :data:`MEETING_AFTER` real steps, less its price on the measuring processes' link, measured back to back).
    Charged once per periodic round (local SGD's averaging, DiLoCo's outer round)."""
    ranks = compute.processes
    if compute.allreduce_params <= 0 or ranks < 2:
        return 0.0
    return max(0.0, compute.allreduce_params - allreduce(at_measuring(compute, net), ranks, facts.param_bytes))


def allreduce_cpu(net: Network, ranks: int, nbytes: float) -> float:
    """CPU-seconds one rank spends in a flat ring all-reduce: it sends and receives 2(N−1)/N · S bytes
    in 2(N−1) steps (see :meth:`Link.cpu`; a step both sends and receives, so its bytes cost β)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    link = net.link(ranks)
    messages, moved = ring_terms(ranks, nbytes)
    return moved * link.beta + (messages * link.alpha if link.shared_copy else 0.0)


def gather_or_scatter(net: Network, ranks: int, nbytes: float) -> float:
    """A ring all-gather or reduce-scatter of ``nbytes`` in all: (N−1)·α + (N−1)/N · S·β."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    link = net.link(ranks)
    return (ranks - 1) * link.alpha + (ranks - 1) / ranks * nbytes * link.beta


def cpu_bound(work_seconds: float, cores: Optional[int]) -> float:
    """The shortest a step can be when a node's processes need ``work_seconds`` of CPU and have ``cores``."""
    return 0.0 if cores is None else work_seconds / cores
