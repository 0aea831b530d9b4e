"""How workers send their reports home: one pipe per rank, read by the parent.

Not a ``multiprocessing`` queue: its two locks are named POSIX semaphores (files in ``/dev/shm``) that live
as long as the job, and only the parent's exit unlinks them, so a job ended by SIGKILL as a whole (an
out-of-memory killer, ``kill -9 -PGID``) would leave them behind (``sem.mp-*``, or ``sem.loky-*`` where
scikit-learn's joblib has renamed multiprocessing's semaphores). A pipe is two file descriptors, which the
kernel closes with the process; one writer per pipe needs no lock.

Every worker receives every rank's writer (the launcher hands all ranks the same arguments) and closes all but
its own first thing (:meth:`ReportPipes.own`); the parent closes its copies of the writers once the workers
have theirs, so a rank's pipe reads end-of-file once that rank is gone.
"""

from __future__ import annotations

import dataclasses
from multiprocessing.connection import Connection
from typing import Any

from ..kinds import Kind


class Sent(Kind):
    """Which of the three things a worker sends home a report is."""

    RESULT = "result"  #: rank 0's return value
    ERROR = "error"  #: a PhalanxError of its own (bad input found inside it, or a failure it diagnosed)
    CRASH = "crash"  #: anything else, with its traceback


#: what a worker raised (the reports that name a failure, not a result)
RAISED = (Sent.CRASH, Sent.ERROR)


@dataclasses.dataclass(frozen=True)
class Report:
    """What a worker sends home: its result (rank 0), its own PhalanxError, or a crash's traceback."""

    kind: Sent  #: which of the three it is
    rank: int
    #: when (time.time()): when one worker crashes its peers crash next ("connection closed"), and
    #: the parent must name the first, not whichever it happened to notice
    at: float = 0.0
    value: bytes = b""  #: a result: rank 0's return value, saved by torch.save
    error: str = ""  #: an error: the PhalanxError subclass's name, rebuilt as itself in the parent
    text: str = ""  #: an error's message or a crash's traceback


class ReportPipes:
    """``n`` one-way pipes from the workers to the parent."""

    def __init__(self, context: Any, n: int):
        pairs = [context.Pipe(duplex=False) for _ in range(n)]
        self.readers: list[Connection] = [r for r, _ in pairs]
        self.writers: list[Connection] = [w for _, w in pairs]

    def own(self, rank: int) -> Connection:
        """In worker ``rank``: its writer; every other end this process received is closed."""
        for i, end in enumerate(self.readers + self.writers):
            if end is not self.writers[rank]:
                end.close()
        return self.writers[rank]

    def started(self) -> None:
        """In the parent, once the workers are started (they received their copies): close ours of the writers."""
        for w in self.writers:
            w.close()

    def drain(self) -> list:
        """Every report that arrived, in rank order (each report carries its own time)."""
        out = []
        for r in self.readers:
            try:
                while not r.closed and r.poll():
                    out.append(r.recv())
            except (EOFError, OSError):  # that rank is gone, or ended in the middle of a report
                r.close()
        return out

    def close(self) -> None:
        for r in self.readers:
            r.close()


__all__ = ["ReportPipes"]
