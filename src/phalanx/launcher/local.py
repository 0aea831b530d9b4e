"""Start and watch the workers of a job on one machine (or hand over to :mod:`.joined`).

The parent process owns a ``TCPStore`` listening on 127.0.0.1 only (so do the workers' groups: see
:mod:`.loopback`), with a port the kernel chose (never a fixed port, so two jobs never collide), and starts
one process per worker, forked by a fork server that imported torch once
(:mod:`phalanx.launcher.forkserver`); every worker joins the process group through that store.

Failure: the parent polls its children; the first one that raises or dies takes the job down
(the others get SIGTERM, then SIGKILL) and the parent raises :class:`WorkerFailed` with that
rank and its traceback. A :class:`PhalanxError` raised inside a worker (bad input discovered
late) is carried back as itself so the CLI still prints one line and exits 2. A worker that ends
at once on a stop signal (before its first step) is a stop request, not a failure (:mod:`.stopping`).

World size 1 runs in the calling process with no process group at all.
"""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing import connection as mp_connection
from multiprocessing import reduction
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import errors
from ..comm import shaped_link
from ..errors import JobHung, PhalanxError, WorkerFailed
from ..kinds import Kind
from ..log import show_on_streams, shown_on_streams
from . import loopback
from .forkserver import fork_loader_server, start_method
from .watch import Progress, Watcher, is_gone, launcher_view, say_gone, say_raised, store_client
from .survivors import let_survivors_save
from .startup import resume_collector
from .context import DEFAULT_TIMEOUT_S, init_worker, local_world_size, shutdown, threads_per_worker
from .env import joined
from .joined import collect_before_exit, run_joined
from .report_pipes import ReportPipes
from .stop_signals import record_until_ready
from .stopping import STOP_CODES, Forward, signals_to


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


def _spawned_worker(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple,
    devices: Sequence[torch.device],
    threads: int | None,
    addr: str,
    port: int,
    timeout_s: float,
    results: ReportPipes,
    watched: bool = True,
    parents: Optional["_Parents"] = None,
    shown: bool = False,
    loader_modules: Optional[list[str]] = None,
) -> None:
    resume_collector()  # forked from the server, which imported with the collector off (startup.py)
    record_until_ready(local_rank)  # a stop signal from here on ends it once its handlers are in (stop_signals.py)
    home = results.own(local_rank)
    if parents is not None:
        parents.adopt()
    if shown:  # the parent shows phalanx's messages on its streams (the command line): so does its worker
        show_on_streams()
    if loader_modules is not None:  # (with the parent's environment and streams, before any thread of this worker's)
        fork_loader_server(loader_modules)
    world_size = len(devices)
    progress = Progress(local_rank)
    progress.handle_signals()  # SIGTERM/SIGINT: stop at a step boundary, not a KeyboardInterrupt traceback
    code = 0
    store = None
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        if watched:
            progress.publish(store_client(addr, port, timeout_s))
        ctx = init_worker(local_rank, world_size, local_rank, devices[local_rank], threads, store, timeout_s,
                          progress=progress)
        value = fn(ctx, *args)
        if local_rank == 0:
            home.send(Report(Sent.RESULT, 0, value=_to_bytes(value)))
        progress.at(progress.step, "leaving")
        _leave_together(launcher_view(store), world_size)
    except PhalanxError as e:
        # Bad input found inside a worker (or a failure it diagnosed itself, such as a server that lost
        # every worker): send the message home, then fail so the rest stop too.
        text = e.detail if isinstance(e, WorkerFailed) else str(e)
        home.send(Report(Sent.ERROR, local_rank, time.time(), error=type(e).__name__, text=text))
        say_raised(store, local_rank)
        code = 3
    except BaseException:
        home.send(Report(Sent.CRASH, local_rank, time.time(), text=traceback.format_exc()))  # the parent says it
        say_raised(store, local_rank)  # (a parameter server must not take a bug for a lost worker)
        code = 1
    finally:
        progress.close()
        shutdown()
    # Skip the interpreter's teardown, on success and on failure alike: a gloo thread still alive
    # (torch keeps the group referenced once DDP or a server thread used it) is ended inside a
    # noexcept C++ destructor during finalization and aborts the process ("terminate called without
    # an active exception"; see :func:`leave`). The reports went through a pipe (:mod:`.report_pipes`), whose send
    # writes to the pipe before it returns, so nothing is lost.
    collect_before_exit()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Parents:
    """The parent's environment and standard output and error as they are now, handed to a worker.

    A spawned worker inherits them; one forked by the fork server would have the server's, which are
    the parent's as they were when the server started (a later ``os.environ`` change, or pytest's
    capture of fds 1 and 2, would not reach it), and it would be outside a shaped link's network namespace
    (``namespace``). Pickled for the worker: the streams and the namespace travel as file descriptors
    (``reduction.DupFd``), as multiprocessing passes its own pipes.
    """

    def __init__(self, env: Optional[dict] = None, streams: Optional[dict] = None, namespace: Any = None):
        self.env = dict(os.environ) if env is None else env
        self.streams = streams or {}
        self.namespace = namespace  # (the parent's file descriptor; in the worker, its copy to take)

    def __reduce__(self):
        return _Parents, (self.env, {fd: reduction.DupFd(fd) for fd in (1, 2) if _is_open(fd)},
                          None if self.namespace is None else reduction.DupFd(self.namespace))

    def adopt(self) -> None:
        """In the worker, before anything else: the parent's environment and streams become ours, and on a shaped
        link (``--link``) so does the parent's network namespace."""
        if self.namespace is not None:
            shaped_link.join(self.namespace.detach())
        os.environ.clear()
        os.environ.update(self.env)
        for target, stream in self.streams.items():
            fd = stream.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _leave_together(store: dist.Store, world_size: int, wait_s: float = 10.0) -> None:
    """Wait until every rank is done before closing connections, through the store (silently).

    Every rank counts itself out; the ranks that will not (an asynchronous strategy's lost worker: one the
    parent saw die, or a frozen one its server dropped) are counted gone (``watch.say_gone``). The deadline
    lets the others leave anyway where a rank is neither.
    """
    try:
        store.add("left", 1)
        deadline = time.monotonic() + wait_s
        while store.add("left", 0) + store.add("gone", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # the store is gone: so is everyone else
        pass


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


def launch(
    fn: Callable[..., Any],
    devices: Sequence[torch.device | str],
    args: tuple = (),
    *,
    threads: int | None = None,
    addr: str = "127.0.0.1",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    tolerate: Optional[Callable[[int], bool]] = None,
    hang_timeout_s: float = 0.0,
    label: Optional[Callable[[int], str]] = None,
    lockstep: bool = True,
    survivors_save: bool = False,
    loader_modules: Optional[list[str]] = None,
) -> Any:
    """Run ``fn(ctx, *args)`` on one worker per entry of ``devices`` (``torch.device`` or its name); return rank 0's
    result.

    ``fn`` and ``args`` must be picklable: workers start as forks of the fork server (see
    :mod:`phalanx.launcher.forkserver`), which imported torch and phalanx but not this caller's objects.
    Inside torchrun or srun this process is the worker: ``devices`` is indexed by its local rank.
    A rank for which ``tolerate(rank)`` holds may die without ending the job. With
    ``hang_timeout_s`` > 0 the parent watches every rank's progress and ends a job in which no
    rank it needs moved for that long with :class:`JobHung` naming who is stuck where. SIGTERM
    and SIGINT are passed on to the workers, which stop together at a step boundary; a second
    one stops them at once. With ``survivors_save`` (every rank holds the whole model), a worker that dies
    without a word leaves the others time to save what they hold (:mod:`.survivors`) before they are ended.
    Where each worker will read a Dataset with DataLoader workers (``loader_modules``: the modules defining it),
    each forks their fork server from itself as it starts (:func:`~phalanx.launcher.forkserver.fork_loader_server`).
    """
    places = [torch.device(d) for d in devices]  # ("cpu" or "cuda:1" as typed, or a torch.device)
    job = joined()
    if threads is None and all(d.type == "cpu" for d in places):
        # Slurm says how many cores a task has (--cpus-per-task); otherwise a share of this machine's.
        threads = (job.threads if job is not None else None) or threads_per_worker(local_world_size(len(places)))
    if job is not None:
        return run_joined(job, fn, places, args, threads, timeout_s)
    if len(places) == 1:
        ctx = init_worker(0, 1, 0, places[0], threads, None, timeout_s)
        with signals_to(lambda name: ctx.progress.request_stop(name)):
            return fn(ctx, *args)

    store = loopback.store(addr, len(places), timeout_s)  # on addr only (torch's own: on every interface)
    method = start_method()
    results = ReportPipes(mp.get_context(method), len(places))
    procs = mp.start_processes(
        _spawned_worker,
        args=(fn, args, places, threads, addr, store.port, timeout_s, results, hang_timeout_s > 0,
              _Parents(loopback.worker_environment(), namespace=shaped_link.namespace()),
              shown_on_streams(), loader_modules if method == "forkserver" else None),
        nprocs=len(places),
        join=False,
        start_method=method,
    )
    results.started()
    watcher = Watcher(launcher_view(store), len(places), hang_timeout_s, label or (lambda r: f"rank {r}"),
                      tolerate or (lambda r: False), lockstep)
    try:
        received = _monitor(procs.processes, results, tolerate, watcher, survivors_save)
    finally:
        _terminate(procs.processes)  # whatever happened, no worker outlives the launch
        results.close()
    for report in received:
        if report.kind is Sent.RESULT:
            return torch.load(io.BytesIO(report.value), weights_only=False)
    return None


def _monitor(processes: list, results: ReportPipes, tolerate: Optional[Callable[[int], bool]],
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
    forward = Forward(processes, alive, _terminate, watcher.label)
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
                _terminate([processes[r] for r in alive])
                raise _failure(received + results.drain(), (raised, "raised an exception"), killed=False,
                               last_step=watcher.last_step(raised))
            if done_at is not None and (all(is_gone(watcher.store, r) for r in alive)
                                        or time.monotonic() - done_at > LEAVE_GRACE_S):
                break  # the result is home; who is left is frozen (its server dropped it), or is by now
            if done_at is None and watcher.hung():
                report = watcher.report()
                _terminate([processes[r] for r in alive])
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
                _terminate([processes[r] for r in alive])
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
    _terminate([processes[r] for r in alive])
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


def _terminate(processes: list) -> None:
    """End these workers now: SIGKILL (workers take SIGTERM as a request to stop at a step boundary,
    and checkpoints are written atomically, so nothing is torn)."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join()


def _to_bytes(value: Any) -> bytes:
    """Tensors would cross the queue as shared-memory handles that die with this process."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


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
