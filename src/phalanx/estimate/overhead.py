"""What a step costs beyond its compute and the bytes it moves: measured, with a model too small to cost anything else.

A real ``sync`` step runs DDP's machinery (its forward pre-work, a hook per gradient, the reducer's
bookkeeping, launching and waiting for each bucket's all-reduce on gloo's threads); a real ``ps``
update runs the parameter server's protocol (a header message each way, the server's receiving
thread handing the push to its main loop, the update's bookkeeping, the reply handed to a sender
thread). None of that grows with the model, and under contention for the cores it is milliseconds,
not microseconds. The cost models price compute and bytes; this measures the rest, inside the
estimate's measuring processes (the K that would share a node, competing as workers do), with the
real code on a 2-parameter model:

- ``ddp_tiny``: a DDP step of that model minus the same step without DDP (its one 8-byte all-reduce
  included; the cost model takes out what it prices itself, ``costs/sync.ddp_fixed``);
- ``allreduce_tiny``: that model's 8-byte all-reduce alone (what a periodic averaging pays beyond its
  bytes: ``costs/inputs.wake``);
- ``round_trip_tiny``: where a parameter server runs beside the workers, a ps worker's push-to-reply
  round trip through the real server (``strategies/ps``), while the other workers compute real
  steps: under contention, the server's threads wait for a core (its two messages each way are
  taken out by ``costs/ps.round_trip_fixed``).

Each timed round comes right after one real step of the model (``work``), as in training: gloo's and
the server's threads have gone idle during it, and waking them is part of what a step pays. Timed
back to back instead, the threads are still awake: on the 2-core machine this was written on, an
8-byte all-reduce took 0.6 ms back to back and 2.7 ms after 5 ms of compute, and the cnn's real DDP
step paid about 3.3 ms over its bare step where the back-to-back figures priced 1.2. In a round the
rank that arrives last waited for nobody, so a round's time is the least over the ranks.

Both need two processes or more; alone, a process measures neither (0: nothing to add).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

STEPS = 30  #: timed rounds of each (after WARMUP), fewer where a real step is long (ROUNDS_BUDGET_S)
WARMUP = 5
MIN_STEPS = 5
ROUNDS_BUDGET_S = 1.5  #: seconds of real steps the timed rounds of one measurement may take


def fixed_costs(ctx, beside: int, work: Callable[[], None], step_s: float) -> dict:
    """This rank's ``ddp_tiny``, ``allreduce_tiny`` and ``round_trip_tiny`` in seconds (every measuring rank calls it).

    ``work`` runs one real training step of the model (``step_s`` seconds; 0 where the rank runs
    none). Without a process beside the workers (``beside`` 0), a DDP step's excess and an all-reduce,
    each round after a real step. With a parameter server beside them (rank 0), the round trip as a real ps
    worker meets it: worker rank 1 computes a real step, then pushes, while every other worker runs
    real steps again and again, so the server's threads wake up on cores the workers keep busy.
    Ranks that time nothing return None for it."""
    if not ctx.distributed or ctx.world_size < 2:
        return {"ddp_tiny": 0.0, "allreduce_tiny": 0.0, "round_trip_tiny": 0.0}
    rounds = _rounds(step_s)
    if not beside:
        return {"ddp_tiny": _ddp_tiny(work, rounds), "allreduce_tiny": _allreduce_tiny(work, rounds),
                "round_trip_tiny": None}
    return {"ddp_tiny": None, "allreduce_tiny": None, "round_trip_tiny": _round_trip_tiny(ctx, work, rounds)}


def _rounds(step_s: float) -> int:
    """Timed rounds every rank agrees on: :data:`STEPS`, fewer where the slowest rank's real step is long."""
    slowest = torch.tensor([step_s], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return max(MIN_STEPS, min(STEPS, int(ROUNDS_BUDGET_S / max(slowest.item(), 1e-9))))


def _tiny() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)  # the same weights on every rank, as DDP requires
    return nn.Linear(1, 1), torch.ones(4, 1), torch.zeros(4, 1)


def _after_work(op: Callable[[], None], work: Callable[[], None], rounds: int) -> list[float]:
    """Seconds of ``op`` in each timed round, each right after a real step of the workers' model (``work``)."""
    seconds = []
    dist.barrier()  # every rank starts at once, as workers do
    for i in range(WARMUP + rounds):
        work()
        t = time.perf_counter()
        op()
        if i >= WARMUP:
            seconds.append(time.perf_counter() - t)
    return seconds


def _training_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One training step (forward, loss, backward, SGD step) of ``model``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

    def step() -> None:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _ddp_tiny(work: Callable[[], None], rounds: int) -> float:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, x, y = _tiny()
    bare = statistics.median(_after_work(_training_step(copy.deepcopy(model), x, y), work, rounds))
    return max(0.0, _least_over_ranks(_after_work(_training_step(DDP(model), x, y), work, rounds)) - bare)


def _allreduce_tiny(work: Callable[[], None], rounds: int) -> float:
    tiny = torch.zeros(2)
    return _least_over_ranks(_after_work(lambda: dist.all_reduce(tiny), work, rounds))


def _least_over_ranks(seconds: list[float]) -> float:
    """The median over rounds of each round's least time over the ranks: the rank that arrived last waited for
    no other's compute."""
    each = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(each, op=dist.ReduceOp.MIN)
    return statistics.median(each.tolist())


DONE = "phalanx/estimate/round-trips-done"


def _round_trip_tiny(ctx, work: Callable[[], None], rounds: int) -> Optional[float]:
    """Rank 0 serves worker rank 1 (the real :class:`~phalanx.strategies.ps.server.Server`), which computes a
    real step before each push and times the reply; the other ranks compute until it is done (it says so
    in the job's store)."""
    from ..strategies.ps.aggregate import Asynchronous
    from ..strategies.ps.protocol import WorkerChannel
    from ..strategies.ps.server import Server

    model, _, _ = _tiny()
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
    return statistics.median(seconds[WARMUP:] or seconds)
