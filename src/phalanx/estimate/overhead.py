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
- ``round_trip_tiny``: a ps worker's push-to-reply round trip through the real server
  (``strategies/ps``), one worker per measuring process but rank 0 (its two messages each way are
  taken out by ``costs/ps.round_trip_fixed``).

Both need two processes or more; alone, a process measures neither (0: nothing to add).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

STEPS = 30  #: timed steps of each (after WARMUP)
WARMUP = 5
TINY_BYTES = 8  #: the 2-parameter model's gradient


def fixed_costs(ctx) -> dict:
    """``ddp_tiny`` and ``round_trip_tiny`` in seconds, this rank's (every rank calls it; the server's round
    trip is None: it times none). Alone, a process measures neither: 0."""
    if not ctx.distributed or ctx.world_size < 2:
        return {"ddp_tiny": 0.0, "round_trip_tiny": 0.0}
    return {"ddp_tiny": _ddp_tiny(), "round_trip_tiny": _round_trip_tiny(ctx)}


def _tiny() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)  # the same weights on every rank, as DDP requires
    return nn.Linear(1, 1), torch.ones(4, 1), torch.zeros(4, 1)


def _steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Median seconds of a training step (forward, loss, backward, SGD step) of ``model``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seconds = []
    dist.barrier()  # every rank steps at once, as workers do
    for i in range(WARMUP + STEPS):
        t = time.perf_counter()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= WARMUP:
            seconds.append(time.perf_counter() - t)
    return statistics.median(seconds)


def _ddp_tiny() -> float:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, x, y = _tiny()
    bare = _steps(copy.deepcopy(model), x, y)
    wrapped = _steps(DDP(model), x, y)
    return max(0.0, wrapped - bare)


def _round_trip_tiny(ctx) -> Optional[float]:
    """Rank 0 serves (the real :class:`~phalanx.strategies.ps.server.Server`), the others push and time replies."""
    from ..strategies.ps.aggregate import Asynchronous
    from ..strategies.ps.protocol import WorkerChannel
    from ..strategies.ps.server import Server

    model, _, _ = _tiny()
    workers = ctx.world_size - 1
    rounds = WARMUP + STEPS
    if ctx.rank == 0:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        server = Server(model, optimizer, ctx.world_size, ctx.device, None, Asynchronous(workers), rounds)
        while server.global_step() < rounds:
            server.serve_one_step()
        server.drain()
        return None
    channel = WorkerChannel(2, 0, ctx.device)
    channel.hello()
    reply, _, _ = channel.reply()
    grad, empty = torch.zeros(2), torch.zeros(0, dtype=torch.float64)
    seconds, pushes = [], 0
    while not reply.stop:
        t = time.perf_counter()
        channel.push(reply.version, 0.0, grad, empty)
        pushes += 1
        reply, _, _ = channel.reply()
        seconds.append(time.perf_counter() - t)
    channel.bye(pushes)
    timed = seconds[WARMUP:] or seconds
    return statistics.median(timed)
