"""What a stage boundary costs: one-way seconds of a message between neighbouring stages.

Who talks to whom: before the partition exists, every pair of neighbouring ranks of each
pipeline (stage s and s+1 of one replica) ping-pongs messages of the sizes a cut could send
(the outputs of the blocks, for one micro-batch), over the same process group and device that
training uses. Pairs of even boundaries measure first, then odd ones, so no rank is in two
pairs at once; the others wait. Then every rank all-gathers every pair's figures and takes the
median per size over the boundaries (on one machine all links are alike; where they are not,
the median is the typical link), so every rank prices a cut the same way.

At most :data:`MAX_SIZES` sizes are measured (spread evenly in log-size over the sizes a cut can
have); :func:`interpolate` prices the rest piecewise linearly in bytes.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

MAX_SIZES = 6
REPEATS = 10  #: round trips per size, after one warm-up


def probe_sizes(nbytes: Sequence[int], most: int = MAX_SIZES) -> list[int]:
    """The distinct sizes to measure: all of them, or ``most`` spread evenly in log-size (ends kept)."""
    sizes = sorted({max(1, int(n)) for n in nbytes})
    if len(sizes) <= most:
        return sizes
    lo, hi = math.log(sizes[0]), math.log(sizes[-1])
    wanted = [math.exp(lo + (hi - lo) * k / (most - 1)) for k in range(most)]
    return sorted({min(sizes, key=lambda s: abs(math.log(s) - math.log(w))) for w in wanted})


def interpolate(sizes: Sequence[int], seconds: Sequence[float], nbytes: int) -> float:
    """Seconds for ``nbytes``, piecewise linear between the measured sizes (flat-sloped beyond them)."""
    if not sizes:
        return 0.0
    if len(sizes) == 1:
        return float(seconds[0]) * (nbytes / sizes[0] if nbytes > sizes[0] else 1.0)
    if nbytes <= sizes[0]:
        return float(seconds[0])
    for (a, ta), (b, tb) in zip(zip(sizes, seconds), zip(sizes[1:], seconds[1:])):
        if nbytes <= b:
            return float(ta + (tb - ta) * (nbytes - a) / (b - a))
    a, b = sizes[-2], sizes[-1]
    slope = (seconds[-1] - seconds[-2]) / (b - a)
    return float(seconds[-1] + max(slope, 0.0) * (nbytes - b))


def pairs(stages: int, round_: int) -> list[tuple[int, int]]:
    """The (stage, stage + 1) pairs that measure in round 0 (even boundaries) or 1 (odd ones)."""
    return [(b, b + 1) for b in range(round_, stages - 1, 2)]


def agree(rows: Sequence[Optional[Sequence[float]]]) -> list[float]:
    """Per size, the median over the boundaries that measured it (rows of None: ranks with no pair)."""
    measured = [row for row in rows if row is not None]
    if not measured:
        return []
    return [float(statistics.median(row[i] for row in measured)) for i in range(len(measured[0]))]


def _ping_pong(peer: int, first: bool, buffer: torch.Tensor, group, device: torch.device) -> float:
    """Median one-way seconds (half a round trip) of ``buffer`` between this rank and ``peer``."""
    trips = []
    for _ in range(REPEATS + 1):
        start = time.perf_counter()
        if first:
            dist.send(buffer, peer, group=group)
            dist.recv(buffer, peer, group=group)
        else:
            dist.recv(buffer, peer, group=group)
            dist.send(buffer, peer, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips[1:]) / 2


def time_messages(nbytes: Sequence[int], pipeline_ranks: Sequence[int], stage: int, device: torch.device,
                  group=None) -> tuple[list[int], list[float]]:
    """(sizes measured, one-way seconds each), the same on every rank (see the module docstring).

    ``pipeline_ranks``: the global ranks of this rank's pipeline in stage order; ``group``: the
    group they talk in (None: the default group). Every rank of the job must call this.
    """
    sizes = probe_sizes(nbytes)
    mine: Optional[list[float]] = None
    for round_ in (0, 1):
        for lo, hi in pairs(len(pipeline_ranks), round_):
            if stage in (lo, hi):
                peer = pipeline_ranks[hi if stage == lo else lo]
                seconds = [_ping_pong(peer, stage == lo, torch.empty(n, dtype=torch.uint8, device=device), group,
                                      device) for n in sizes]
                if stage == lo:
                    mine = seconds
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    return sizes, agree(rows)
