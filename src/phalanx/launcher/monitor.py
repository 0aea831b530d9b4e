"""Watch a job's workers until they end (the parent's side of :func:`.local.launch`).

The parent waits on every worker's process and reads their reports meanwhile (:mod:`.report_pipes`). The first
worker that raises or dies takes the job down: the others are ended and the parent raises :class:`WorkerFailed`
with that rank and its traceback, or the worker's own :class:`PhalanxError` rebuilt as itself (bad input found
late: the CLI still prints one line and exits 2). A rank the job may lose (an asynchronous strategy's worker)
dies without ending it; a worker that ends at once on a stop signal is a stop request, not a failure
(:mod:`.stopping`); a job in which no rank it needs moves for ``--hang-timeout`` seconds ends with
:class:`JobHung` naming who is stuck where (:mod:`.watch`, :mod:`.hang_report`).
"""

from __future__ import annotations

import signal
import time
from multiprocessing import connection as mp_connection
from typing import Callable, Optional

from .. import errors
from ..errors import JobHung, PhalanxError, WorkerFailed
from .report_pipes import RAISED, Report, ReportPipes, Sent
from .stopping import STOP_CODES, Forward, signals_to
from .survivors import let_survivors_save
from .watch import Watcher, is_gone, say_gone


def monitor(processes: list, results: ReportPipes, tolerate: Optional[Callable[[int], bool]],
            watcher: Watcher, survivors_save: bool = False) -> list[Report]:
    """Wait for every worker; drain their reports meanwhile; on a failure or a hang stop the rest and raise.

    A rank for which ``tolerate(rank)`` is true may die without ending the job (an asynchronous
    strategy's worker: its server carries on without it). Once rank 0 has delivered its result,
    ranks that are still alive after a grace period (a frozen worker its server dropped) are
    ended. Signals received meanwhile are passed on to every worker, and a worker that ended on
    one before its first step asks the same of the job (see :mod:`.stopping`).
    """
    received: list[Report] = []
    alive = set(range(len(processes)))
    done_at: Optional[float] = None
    forward = Forward(processes, alive, terminate, watcher.label)
    with signals_to(forward):
        while alive:
            # Drain while waiting: a large result blocks its sender until the pipe is read.
            received += results.drain()
            if done_at is None and any(r.kind is Sent.RESULT for r in received):
                done_at = time.monotonic()
            mp_connection.wait([processes[r].sentinel for r in alive], timeout=0.2)
            for rank in _exited(processes, alive):
                _ended(rank, processes, alive, results, received, tolerate, watcher, forward, survivors_save)
            raised = _expendable_that_raised(processes, alive, received, tolerate) if done_at is None else None
            if raised is not None:  # a bug (the user's model, say), not a lost machine: end the job with it
                terminate([processes[r] for r in alive])
                raise _failure(received + results.drain(), (raised, "raised an exception"), killed=False,
                               last_step=watcher.last_step(raised))
            if done_at is not None and (all(is_gone(watcher.store, r) for r in alive)
                                        or time.monotonic() - done_at > LEAVE_GRACE_S):
                break  # the result is home; who is left is frozen (its server dropped it), or is by now
            if done_at is None and watcher.hung():
                report = watcher.report()
                terminate([processes[r] for r in alive])
                raise JobHung(f"the job made no progress for {watcher.timeout:g} s (--hang-timeout): {report}")
    received += results.drain()
    if forward.first is not None and not any(r.kind is Sent.RESULT for r in received):
        raise forward.stopped(watcher.steps_made())  # every worker ended before it could stop at a step
    return received


def _exited(processes: list, alive: set) -> list[int]:
    """The ranks that have exited, those that ended on a stop signal first: a rank signalled before its
    first step ends at once, and its peers fail in their next collective a moment later; the stop, not
    their gloo tracebacks, is what happened (and the order in which exits are seen is the kernel's)."""
    done = [r for r in alive if processes[r].exitcode is not None]
    # (then a rank killed by a signal: its peers fail in their next collective with it, or save first and fail)
    return sorted(done, key=lambda r: (processes[r].exitcode not in STOP_CODES, processes[r].exitcode >= 0, r))


def _ended(rank: int, processes: list, alive: set, results: ReportPipes, received: list[Report],
           tolerate: Optional[Callable[[int], bool]], watcher: Watcher, forward: Forward,
           survivors_save: bool = False) -> None:
    """Rank ``rank`` exited: carry on without it, take its exit as the job's stop request, or end the job."""
    if rank not in alive:  # (already taken: a stop exit seen while another rank's failure was looked at)
        return
    code = processes[rank].exitcode
    alive.discard(rank)
    if code == 0:
        return
    if code in STOP_CODES or (tolerate is not None and tolerate(rank)):
        say_gone(watcher.store, rank)  # the others need not wait for it to leave
        if code in STOP_CODES:
            forward.worker_stopped(rank, code)
            if not watcher.steps_made():
                # Nothing to save yet, and a peer blocked in the rendezvous (torch's C++) runs no signal handler
                # until the rendezvous times out: end the rest now.
                terminate([processes[r] for r in alive])
                raise forward.stopped(False)
        return
    last_step = watcher.last_step(rank, since=time.time())  # (waits up to a second: a stop exit may show meanwhile)
    for other in _exited(processes, alive):
        if processes[other].exitcode in STOP_CODES:
            _ended(other, processes, alive, results, received, tolerate, watcher, forward)
    received += results.drain()
    # Died without a word (killed, out of memory), not raised: where every rank holds the whole model the others
    # save it first, then fail in their own time; the death stays the failure named.
    died = code < 0 or not any(r.rank == rank and r.kind in RAISED for r in received)
    if survivors_save and died:
        say_gone(watcher.store, rank)  # (the survivors need not wait for it to say it survived)
        let_survivors_save(processes, alive, watcher.store, lambda: received.extend(results.drain()))
    terminate([processes[r] for r in alive])
    received += results.drain()
    steps_made = watcher.steps_made()
    if forward.explains_failure(steps_made):
        raise forward.stopped(steps_made)
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    killed = code < 0 or (survivors_save and died)  # (the survivors' own failures come after it)
    raise _failure(received, (rank, f"process {processes[rank].pid} {how}"), killed=killed, last_step=last_step)


def _expendable_that_raised(processes: list, alive: set, reports: list[Report],
                            tolerate: Optional[Callable[[int], bool]]) -> Optional[int]:
    """A rank the job may lose that reported an exception of its own (it may still be alive, stuck in
    its teardown): a killed rank reports nothing, so one that raised has a bug that must end the job.
    Not when a rank the job needs just died (a server killed makes its workers' receives fail): its
    death is the cause, and the exit check names it."""
    if tolerate is None:
        return None
    raised = [r.rank for r in reports if r.kind in RAISED and tolerate(r.rank)]
    if not raised:
        return None
    needed = [processes[r] for r in alive if not tolerate(r)]
    # A dying server's sentinel closes with its sockets, a moment before it can be reaped: join it.
    for sentinel in mp_connection.wait([p.sentinel for p in needed], timeout=1.0):
        next(p for p in needed if p.sentinel == sentinel).join(5.0)
    return None if any(p.exitcode not in (None, 0) for p in needed) else raised[0]


#: How long ranks may take to leave once rank 0 delivered its result.
LEAVE_GRACE_S = 15.0


def terminate(processes: list) -> None:
    """End these workers now: SIGKILL (workers take SIGTERM as a request to stop at a step boundary,
    and checkpoints are written atomically, so nothing is torn)."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join()


def _failure(reports: list[Report], first: tuple[int, str], killed: bool, last_step: Optional[int] = None
             ) -> PhalanxError:
    """The error to raise for a failed job.

    A worker's own PhalanxError wins (bad input, the user's to fix, stated plainly); then a process
    killed by a signal (it could not report); then the earliest failure reported: a crash's traceback,
    or a failure a rank diagnosed itself (a WorkerFailed: a parameter server that lost every worker,
    or one that stopped because a worker raised, which the worker's own traceback, earlier, explains);
    then whatever exited first.
    """
    bad_input = min((r for r in reports if r.kind is Sent.ERROR and r.error != "WorkerFailed"),
                    key=lambda r: (r.at, r.rank), default=None)
    if bad_input is not None:
        return _rebuild_error(bad_input.rank, bad_input.error, bad_input.text)
    earliest = min((r for r in reports if r.kind in RAISED), key=lambda r: (r.at, r.rank), default=None)
    if earliest is not None and not killed:
        rank = earliest.rank
        if earliest.kind is Sent.ERROR:
            return _rebuild_error(rank, earliest.error, earliest.text)
        return WorkerFailed(rank, earliest.text.rstrip(), step=last_step if rank == first[0] else None)
    return WorkerFailed(*first, step=last_step)


def _rebuild_error(rank: int, name: str, message: str) -> PhalanxError:
    if name == "WorkerFailed":
        return WorkerFailed(rank, message)  # still a failed run (exit 1), named by its rank
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, PhalanxError):
        try:
            return cls(message)
        except TypeError:
            pass
    return PhalanxError(message)
