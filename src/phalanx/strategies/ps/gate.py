"""The stale-synchronous gate (SSP), as pure logic: may this worker begin its next step?

A worker's clock counts the gradients it has pushed; the slowest live worker's clock is the
floor. With bound K a worker may begin step c (having pushed c) only while c - floor <= K, so no
worker ever runs more than K steps ahead of the slowest (Ho et al., 2013). K = None: no bound
(the asynchronous parameter server). A worker that died no longer holds the floor down.
"""

from __future__ import annotations

from typing import Iterable, Optional


class Gate:
    def __init__(self, workers: Iterable[int], bound: Optional[int]):
        self.bound = bound
        self.clock = {w: 0 for w in workers}
        self.live = set(self.clock)

    def tick(self, worker: int) -> None:
        """``worker`` pushed one more gradient."""
        self.clock[worker] += 1

    def lose(self, worker: int) -> None:
        self.live.discard(worker)

    def slowest(self) -> int:
        """The floor: the smallest clock among live workers (0 when none is left)."""
        return min((self.clock[w] for w in self.live), default=0)

    def lead(self, worker: int) -> int:
        """How many steps ``worker`` is ahead of the slowest live worker."""
        return self.clock[worker] - self.slowest()

    def may_start(self, worker: int) -> bool:
        return self.bound is None or self.lead(worker) <= self.bound
