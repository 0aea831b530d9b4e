"""What a step costs beyond its compute and the bytes the cost models price: measured, as training meets it.

The cost models price compute (measured) and bytes (the link, measured back to back). A real step
pays more, and on a machine whose cores the workers fill it is milliseconds, not microseconds:

- a ``sync`` step runs DDP's machinery (its forward pre-work, a hook per gradient, the reducer's
  bookkeeping, launching and waiting for each bucket's all-reduce on gloo's threads), and its
  all-reduces meet gloo's threads idle after the backward pass: waking them costs more than the
  message does back to back (several times as much, for a DDP step of the digits cnn: the figures are
  in benchmarks/README.md, "Figures behind the code");
- a periodic averaging (local SGD, DiLoCo) follows H steps of compute and meets the same idle threads;
- a ``ps`` update runs the parameter server's protocol (a header message each way, the server's
  receiving thread handing the push to its main loop, the update's bookkeeping, the reply handed to
  a sender thread).

So each is measured in the estimate's measuring processes (the K that would share a node,
competing as workers do), with the user's model and a real batch:

- ``ddp_excess``: a DDP step of the model, in lockstep as training runs it (a rank's mean step: the
  all-reduce holds it to the slowest), minus its bare step (each round's slowest rank, as the
  lockstep's pace), each a mean over rounds; the cost model takes
  out what it prices itself for the same step at K (``costs/sync.ddp_fixed``);
- ``allreduce_params`` and ``meeting_wait``: a periodic meeting as local SGD's holds it: every rank
  computes :data:`costs.inputs.MEETING_AFTER` real steps on its own, then all-reduces the model's
  parameters (one new flat vector, as an averaging makes). ``allreduce_params`` is the all-reduce of
  the rank that arrived last (it waited for no other's compute; ``costs/inputs.wake`` takes out its
  price); ``meeting_wait`` is what the ranks waited beyond it on average, for the slowest one's lead
  (a round's mean over the ranks less its least); each a mean over rounds. Gloo's threads sleep
  through the steps between, so the same all-reduce right after one step is cheaper, and the ranks'
  arrivals drift further apart the more steps they take alone (``costs/inputs.meeting_wait`` scales the
  wait with the root of the steps; the figures are in the same table);
- ``round_trip_tiny``: where a parameter server runs beside the workers, a ps worker's push-to-reply
  round trip of a 2-parameter model through the real server (``strategies/ps``), right after a real
  step, while the other workers compute real steps: under contention, the server's threads wait for
  a core (its two messages each way are taken out by ``costs/ps.round_trip_fixed``); and
  ``round_trip_spread``, their standard deviation: how much a ps worker's cycle varies beyond its
  compute, which decides who reaches the server first (``strategies/ps/simulated.py``);

These are means, not medians: a run's time is the sum of its steps, so a slow round (gloo's threads
woken late, a core taken by the other process) costs it what it costs the mean, and on a machine whose
cores the workers fill the tail is most of the difference between a median and a real run's step (the
figures are in the same table).

All need two processes or more; alone, a process measures none (0: nothing to add).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..costs.inputs import MEETING_AFTER

STEPS = 60  #: timed rounds of each (after WARMUP), fewer where a real step is long (ROUNDS_BUDGET_S)
WARMUP = 5
MIN_STEPS = 5
ROUNDS_BUDGET_S = 1.5  #: seconds of real steps the timed rounds of one measurement may take

Step = Callable[[], None]
#: the figures :func:`fixed_costs` returns (None where a rank times nothing), as named in ``costs.Compute``
FIGURES = ("ddp_excess", "allreduce_params", "meeting_wait", "round_trip_tiny", "round_trip_spread")


def fixed_costs(ctx, beside: int, work: Step, step_s: float, ddp_step: Optional[Callable[[], Step]] = None,
                params: Optional[Callable[[], torch.Tensor]] = None) -> dict:
    """This rank's ``ddp_excess``, ``allreduce_params``, ``meeting_wait``, ``round_trip_tiny`` and
    ``round_trip_spread`` in seconds (every measuring rank calls it).

    ``work`` runs one real training step of the model (``step_s`` seconds; 0 where the rank runs none);
    ``ddp_step`` makes the same step of a DDP-wrapped copy of the model (a collective: every worker calls it
    at once), ``params`` returns the model's parameters as one new flat vector. Without a process beside the
    workers (``beside`` 0), the DDP step's excess and the parameters' all-reduce. With a parameter server
    beside them (rank 0), the round trip as a real ps worker meets it: worker rank 1 computes a real step,
    then pushes, while every other worker runs real steps again and again, so the server's threads wake up
    on cores the workers keep busy. Ranks that time nothing return None for it."""
    if not ctx.distributed or ctx.world_size < 2:
        return dict.fromkeys(FIGURES, 0.0)
    slowest = torch.tensor([step_s], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rounds = _rounds(slowest.item())
    if not beside:
        assert ddp_step is not None and params is not None, "a rank with no process beside it steps DDP"
        return {"ddp_excess": _ddp_excess(work, ddp_step(), rounds),
                **_meeting(work, params, _rounds(slowest.item() * MEETING_AFTER)), "round_trip_tiny": None,
                "round_trip_spread": None}
    trip = _round_trip_tiny(ctx, work, rounds)
    return {"ddp_excess": None, "allreduce_params": None, "meeting_wait": None,
            "round_trip_tiny": None if trip is None else statistics.fmean(trip),
            "round_trip_spread": None if trip is None else statistics.pstdev(trip)}


def _rounds(round_s: float) -> int:
    """Timed rounds (every rank gives the slowest rank's ``round_s``): :data:`STEPS`, fewer where a round is
    long."""
    return max(MIN_STEPS, min(STEPS, int(ROUNDS_BUDGET_S / max(round_s, 1e-9))))


def _timed(step: Step, rounds: int) -> list[float]:
    """Seconds of each of ``rounds`` steps in a row, after :data:`WARMUP` more; every rank starts at once."""
    seconds = []
    dist.barrier()
    for i in range(WARMUP + rounds):
        t = time.perf_counter()
        step()
        if i >= WARMUP:
            seconds.append(time.perf_counter() - t)
    return seconds


def _ddp_excess(work: Step, ddp_step: Step, rounds: int) -> float:
    """The DDP steps' pace over the bare steps', both means; bare and DDP alternate in halves, so that both
    meet the machine as it is.

    DDP's all-reduce holds every rank to the slowest, so a rank's own mean DDP step is the pace (its
    rounds include the waiting; the ranks' means differ by a round's skew at most: the largest is
    taken). Bare steps run apart, so their pace in lockstep is each round's slowest rank, as the cost
    model's ``slowest`` is. (Each round's slowest DDP step would count one hiccup twice: the rank that
    had it and the rank that waited for it finish that round at different times.)"""
    half = max(1, rounds // 2)
    bare, ddp = [], []
    for _ in range(2):
        bare += _timed(work, half)
        ddp += _timed(ddp_step, half)
    return max(0.0, _each_rank(ddp, dist.ReduceOp.MAX) - _over_ranks(bare, dist.ReduceOp.MAX))


def _meeting(work: Step, params: Callable[[], torch.Tensor], rounds: int) -> dict[str, float]:
    """Rounds of :data:`MEETING_AFTER` real steps, then an all-reduce of the parameters (a new flat vector, as
    an averaging makes): the last arriver's all-reduce and the others' wait beyond it, each a mean over
    rounds."""
    seconds = []
    dist.barrier()  # every rank starts at once, as workers do
    for i in range(WARMUP + rounds):
        for _ in range(MEETING_AFTER if i >= WARMUP else 1):
            work()
        flat = params()
        t = time.perf_counter()
        dist.all_reduce(flat)
        if i >= WARMUP:
            seconds.append(time.perf_counter() - t)
    each = torch.tensor(seconds, dtype=torch.float64)
    least, total = each.clone(), each.clone()
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    dist.all_reduce(total)
    mean = total / dist.get_world_size()
    return {"allreduce_params": statistics.fmean(least.tolist()),
            "meeting_wait": statistics.fmean((mean - least).tolist())}


def _over_ranks(seconds: list[float], op) -> float:
    """The mean over rounds of each round's time reduced over the ranks by ``op``: MIN, the rank that arrived
    last (it waited for no other's compute); MAX, the slowest (the pace of steps in lockstep)."""
    each = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(each, op=op)
    return statistics.fmean(each.tolist())


def _each_rank(seconds: list[float], op) -> float:
    """Each rank's mean over its rounds, reduced over the ranks by ``op``."""
    mean = torch.tensor([statistics.fmean(seconds)], dtype=torch.float64)
    dist.all_reduce(mean, op=op)
    return mean.item()


DONE = "phalanx/estimate/round-trips-done"


def _round_trip_tiny(ctx, work: Callable[[], None], rounds: int) -> Optional[list[float]]:
    """Rank 0 serves worker rank 1 (the real :class:`~phalanx.strategies.ps.server.Server`), which computes a
    real step before each push and times the reply (its round trips, after the warm-up); the other ranks
    compute until it is done (it says so in the job's store)."""
    from ..strategies.ps.aggregate import Asynchronous
    from ..strategies.ps.protocol import WorkerChannel
    from ..strategies.ps.server import Server

    torch.manual_seed(0)
    model = nn.Linear(1, 1)  # 2 parameters: the protocol, not the bytes
    rounds = WARMUP + rounds
    dist.barrier()
    if ctx.rank == 0:
        server = Server(model, torch.optim.SGD(model.parameters(), lr=0.0), 2, ctx.device, None, Asynchronous(1),
                        rounds)
        while server.global_step() < rounds:
            server.serve_one_step()
        server.drain()
        return None
    if ctx.rank > 1:
        while not ctx.store.check([DONE]):
            work()
        return None
    channel = WorkerChannel(2, 0, ctx.device)
    channel.hello()
    reply, _, _ = channel.reply()
    grad, empty = torch.zeros(2), torch.zeros(0, dtype=torch.float64)
    seconds, pushes = [], 0
    while not reply.stop:
        work()
        t = time.perf_counter()
        channel.push(reply.version, 0.0, grad, empty)
        pushes += 1
        reply, _, _ = channel.reply()
        seconds.append(time.perf_counter() - t)
    channel.bye(pushes)
    ctx.store.set(DONE, "1")
    return seconds[WARMUP:] or seconds
