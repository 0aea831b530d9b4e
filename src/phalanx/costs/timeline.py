"""Two streams of work, compute and communication, and when each piece ends. Pure.

DDP overlaps the all-reduce of a gradient bucket with the rest of the backward pass; FSDP
prefetches the next unit's parameters while the current one computes. Both are this: ops issued
in order on their own stream, each starting when its stream is free and every op it waits for
has ended. Where compute and communication share one resource (CPU workers that fill every core:
gloo copies bytes on the same cores that compute), put every op on one stream and nothing overlaps.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    stream: str  #: ops on one stream run one after another, in the order given
    seconds: float
    after: tuple[str, ...] = ()  #: ops that must end before this one starts


def schedule(ops: Sequence[Op]) -> dict[str, tuple[float, float]]:
    """(start, end) of every op."""
    free: dict[str, float] = {}
    times: dict[str, tuple[float, float]] = {}
    for op in ops:
        missing = [name for name in op.after if name not in times]
        if missing:
            raise ValueError(f"{op.name} waits for {missing}, which come later or not at all")
        start = max([free.get(op.stream, 0.0)] + [times[name][1] for name in op.after])
        times[op.name] = (start, start + op.seconds)
        free[op.stream] = start + op.seconds
    return times


def finish(ops: Sequence[Op]) -> float:
    """When the last op ends."""
    times = schedule(ops)
    return max((end for _, end in times.values()), default=0.0)


def one_stream(ops: Sequence[Op]) -> list[Op]:
    """The same ops with nothing overlapping (every op on one stream)."""
    return [dataclasses.replace(op, stream="one") for op in ops]
