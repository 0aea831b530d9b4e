"""Inside a worker: the job's stop agreement. A SIGTERM or SIGINT to any process of the job stops every rank
at one step, where the loop saves a checkpoint.

A rank that got the signal itself publishes the request in the job's store (:data:`STOP_KEY`; the first
request is the one named). Every rank reads the store at the same steps (one round trip: every
:data:`STOP_CHECK_EVERY` steps, then about every :data:`STOP_CHECK_S` seconds of steps), so a signal to a
single worker stops the whole job as one reaching the launcher does. Other steps cost an attribute read.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from ..strategies import StopRule

#: How often (in steps) every rank reads the job's stop request from the store at first; at least 2, so
#: that ranks in step (at most one apart) never pass the stop step the first reader proposes.
STOP_CHECK_EVERY = 4
#: After PACE_STEPS steps the ranks agree on a new count of steps between reads, about STOP_CHECK_S
#: seconds of steps (at least STOP_CHECK_EVERY, at most STOP_CHECK_MAX): a read is a round trip to the
#: store, which a fast step must not pay every few steps (benchmarks/README.md, "Figures behind the code").
PACE_STEPS, STOP_CHECK_S, STOP_CHECK_MAX = 32, 0.05, 256
STOP_KEY, STOP_AT_KEY, CADENCE_KEY = "phalanx/stop", "phalanx/stop_at", "phalanx/stop_check_every"
AT_KEY = "phalanx/at"  #: (ranks that meet only now and then) where each rank was at its last check


class StopAgreement:
    """This rank's side of the agreement: when it reads the store, and the step it stops at.

    ``stop_rule`` (the layout's): ranks in step agree on a step ahead of them all; an asynchronous rank
    stops where it reads the request; a parameter server's worker never reads it (the server tells it)."""

    def __init__(self, ctx: Any, stop_rule: StopRule, drift: int = 1):
        self.ctx, self.stop_rule = ctx, stop_rule
        #: how far one rank may run ahead of another (the layout's drift); past 1, ranks say where they are
        self.drift = drift
        self.stop_at: Optional[int] = None  #: the step every rank stops at, once a stop was requested
        self.stop_name: Optional[str] = None  #: the signal that asked for it (on whichever rank it reached)
        self.published = False
        #: steps between store reads, counted from ``check_from`` (every rank the same; see :meth:`check_due`)
        self.check_every, self.check_from, self.paced = STOP_CHECK_EVERY, 0, False
        self.began, self.first = 0.0, 0  # (first: the loop's first step, where the reads are counted from)

    def begin(self, step: int) -> None:
        """The loop's first step: the reads are counted from it (a resume starts every rank alike)."""
        self.check_from, self.first, self.began = step, step, time.perf_counter()

    def reached(self, step: int) -> bool:
        """Whether this rank stops before the step after ``step``: a stop was requested and the step the
        ranks agreed on is reached."""
        if self.stop_at is None:
            self._watch(step)
        return self.stop_at is not None and step >= self.stop_at

    def stopped_by(self, step: int) -> Optional[str]:
        """The signal that stopped the run at ``step`` (None: it was not stopped)."""
        return self.stop_name if self.stop_at is not None and step >= self.stop_at else None

    def _watch(self, step: int) -> None:
        mine = self.ctx.progress.stop_requested
        if mine is not None and not self.published:
            self._publish(mine)
        if not self.ctx.distributed or self.ctx.store is None:  # one process: its own request is the job's
            if mine is not None:
                self.stop_name, self.stop_at = mine, step
        elif self.check_due(step):
            if self.drift > 1:  # where this rank is, before it looks for a request (see agree)
                self.ctx.store.set(f"{AT_KEY}/{self.ctx.rank}", str(step))
            self.stop_at = self.agree(step)

    def _publish(self, name: str) -> None:
        self.published = True
        if self.ctx.distributed and self.ctx.store is not None:
            self.ctx.store.compare_set(STOP_KEY, "", name)  # the first request is the one named

    def check_due(self, step: int) -> bool:
        """Whether ``step`` reads the store. Every rank reads at the same steps: every STOP_CHECK_EVERY
        from the loop's first step, until PACE_STEPS steps are done; there (a check step of every rank)
        each proposes about STOP_CHECK_S seconds of its steps so far and the first proposal stored is
        every rank's count from then on (compare_set). A proposed stop is always the next check step."""
        since = step - self.check_from
        if since % self.check_every:
            return False
        if not self.paced and since >= PACE_STEPS:
            per_step = (time.perf_counter() - self.began) / since
            mine = max(STOP_CHECK_EVERY, min(STOP_CHECK_MAX, round(STOP_CHECK_S / max(per_step, 1e-9))))
            self.check_every = int(self.ctx.store.compare_set(CADENCE_KEY, "", str(mine)))
            self.check_from, self.paced = step, True
        return True

    def agree(self, step: int) -> Optional[int]:
        """At a check step: the step to stop at, once any rank published a request (None: none yet, or
        this rank is told by another when to stop)."""
        rule, store = self.stop_rule, self.ctx.store
        if rule is StopRule.SERVER and self.ctx.rank != 0:
            return None  # a parameter server's worker stops when the server tells it
        if not store.check([STOP_KEY]):
            return None
        self.stop_name = store.get(STOP_KEY).decode()
        if rule in (StopRule.EACH, StopRule.SERVER):
            return step
        # The step proposed is the first check step past every rank. In step with each other, ranks are at most
        # a step apart: none has passed this rank's next check. Ranks that meet only now and then (local SGD:
        # at averagings, up to H steps apart) say where they are at each check, before they look for a request:
        # a rank that looked before the request arrived said so before this rank read it, so the next check
        # past the furthest said is one no rank has passed. Each rank reads the proposal at its next check, at
        # the latest the step proposed, and stops there; the first proposal stored wins (compare_set).
        furthest = max([step, *self._positions()]) if self.drift > 1 else step
        return int(store.compare_set(STOP_AT_KEY, "", str(self.check_step_after(furthest))))

    def _positions(self) -> list[int]:
        """The check steps the other ranks last said they were at (a rank yet to say is before its first)."""
        keys = [f"{AT_KEY}/{r}" for r in range(self.ctx.world_size) if r != self.ctx.rank]
        return [int(self.ctx.store.get(k)) for k in keys if self.ctx.store.check([k])]

    def check_step_after(self, step: int) -> int:
        """The first step after ``step`` at which every rank reads the store: on the first cadence up to the
        step where the ranks agreed a new one (PACE_STEPS after the first), on that one after it. A rank that
        has not reached that step yet reads the cadence the first rank there stored; none stored: no rank has
        passed it, and it is the step."""
        paced_at = self.first + PACE_STEPS
        if step < paced_at:
            return self.first + (step - self.first) // STOP_CHECK_EVERY * STOP_CHECK_EVERY + STOP_CHECK_EVERY
        if self.paced:
            cadence = self.check_every
        elif self.ctx.store.check([CADENCE_KEY]):
            cadence = int(self.ctx.store.get(CADENCE_KEY))
        else:
            return paced_at
        return paced_at + (step - paced_at) // cadence * cadence + cadence
