"""Start and watch the workers of a job on one machine (or hand over to :mod:`.joined`).

The parent process owns a ``TCPStore`` listening on 127.0.0.1 only (so do the workers' groups: see
:mod:`.loopback`), with a port the kernel chose (never a fixed port, so two jobs never collide), and starts
one process per worker, forked by a fork server that imported torch once
(:mod:`phalanx.launcher.forkserver`); every worker joins the process group through that store.

The parent then watches them until they end (:mod:`.monitor`): the first worker that raises or dies takes the
job down, and a worker's own :class:`PhalanxError` (bad input discovered late) is raised in the parent as itself.

World size 1 runs in the calling process with no process group at all.
"""

from __future__ import annotations

import io
import os
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing import reduction
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..comm import shaped_link
from ..errors import PhalanxError, WorkerFailed
from ..log import show_on_streams, shown_on_streams
from . import loopback
from .forkserver import fork_loader_server, start_method
from .watch import Progress, Watcher, launcher_view, say_raised, store_client
from .startup import resume_collector
from .context import DEFAULT_TIMEOUT_S, init_worker, local_world_size, shutdown, threads_per_worker
from .env import joined
from .joined import collect_before_exit, run_joined
from .monitor import monitor, terminate
from .report_pipes import Report, ReportPipes, Sent
from .stop_signals import record_until_ready, signal_self_at_start
from .stopping import signals_to


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
    record_until_ready()  # a stop signal from here on ends it once its handlers are in (stop_signals.py)
    home = results.own(local_rank)
    if parents is not None:
        parents.adopt()
    signal_self_at_start(local_rank)
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
    compiles: bool = False,
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
    ``compiles``: the workers will compile (``--compile``), so a fork server started now imports inductor for them all.
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
    method = start_method(compiles)
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
        received = monitor(procs.processes, results, tolerate, watcher, survivors_save)
    finally:
        terminate(procs.processes)  # whatever happened, no worker outlives the launch
        results.close()
    for report in received:
        if report.kind is Sent.RESULT:
            return torch.load(io.BytesIO(report.value), weights_only=False)
    return None


def _to_bytes(value: Any) -> bytes:
    """Tensors would cross the queue as shared-memory handles that die with this process."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


