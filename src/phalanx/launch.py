"""Start workers on one machine, or join a job that ``torchrun`` or Slurm's ``srun`` started.

Who talks to whom: on one machine the parent process owns a ``TCPStore`` on 127.0.0.1 with a port
the kernel chose (never a fixed port, so two jobs never collide), spawns one process per worker,
and every worker joins the process group through that store. Under ``torchrun`` (``RANK`` and
``WORLD_SIZE`` in the environment) or ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID``) there is nothing to spawn: this process is one worker and joins through
``env://`` or the address Slurm's node list gives (``launch_env.py`` reads which launcher it was),
which is how phalanx runs on several machines.

Failure: the parent polls its children; the first one that raises or dies takes the job down
(the others get SIGTERM, then SIGKILL) and the parent raises :class:`WorkerFailed` with that
rank and its traceback. A :class:`PhalanxError` raised inside a worker (bad input discovered
late) is carried back as itself so the CLI still prints one line and exits 2.

World size 1 runs in the calling process with no process group at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import connection as mp_connection

from . import errors
from .devices import backend_for
from .errors import JobHung, PhalanxError, Stopped, WorkerFailed
from .launch_env import Joined, joined
from .watch import PREFIX, Progress, Watcher, enable_flight_recorder, store_client

#: How long a collective may wait for a peer before gloo/NCCL gives up. A dead peer is normally
#: noticed much sooner, by the parent seeing the process exit.
DEFAULT_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    """Where this worker stands in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: world size 1, no process group
    #: the job's rendezvous store (None: world size 1), for agreements outside the process group
    store: Optional[dist.Store] = dataclasses.field(default=None, compare=False, repr=False)
    #: this rank's published progress and the stop request it received
    progress: Progress = dataclasses.field(default_factory=lambda: Progress(0), compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def in_torchrun() -> bool:
    """True inside a job another launcher started: torchrun (RANK, WORLD_SIZE) or Slurm's srun."""
    return joined() is not None


def launcher_world_size() -> Optional[int]:
    """The world size the launcher fixed (torchrun's WORLD_SIZE, Slurm's task count); None: phalanx spawns."""
    job = joined()
    return job.world_size if job is not None else None


def launcher_rank() -> int:
    """This process's rank in a job another launcher started (0 when phalanx starts the workers itself)."""
    job = joined()
    return job.rank if job is not None else 0


def world_size(devices: Sequence[torch.device]) -> int:
    """Workers in the job: the launcher's world size, else one per device slot."""
    return launcher_world_size() or len(devices)


def local_world_size(default: int) -> int:
    """Workers on this machine (they share its cores)."""
    job = joined()
    return (job.local_world_size or default) if job is not None else default


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_worker(workers: int) -> int:
    """Each CPU worker gets its share of the cores, so workers do not fight over them."""
    return max(1, available_cores() // max(1, workers))


def _init_worker(
    rank: int,
    world_size: int,
    local_rank: int,
    device: torch.device,
    threads: int | None,
    store: dist.Store | None,
    timeout_s: float,
    init_method: str = "env://",
    progress: Optional[Progress] = None,
) -> WorkerContext:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if threads:
        torch.set_num_threads(threads)
    progress = progress or Progress(rank)
    if world_size == 1:
        return WorkerContext(rank, 1, local_rank, device, None, progress=progress)
    backend = backend_for([device])
    enable_flight_recorder()  # so that a hang report can say which collective each rank waits in
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    return WorkerContext(rank, world_size, local_rank, device, backend, store=store, progress=progress)


def _shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _spawned_worker(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple,
    devices: Sequence[torch.device],
    threads: int | None,
    addr: str,
    port: int,
    timeout_s: float,
    results: Any,
    watched: bool = True,
) -> None:
    world_size = len(devices)
    progress = Progress(local_rank)
    progress.handle_signals()  # SIGTERM/SIGINT: stop at a step boundary, not a KeyboardInterrupt traceback
    code = 0
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        if watched:
            progress.publish(store_client(addr, port, timeout_s))
        ctx = _init_worker(local_rank, world_size, local_rank, devices[local_rank], threads, store, timeout_s,
                           progress=progress)
        value = fn(ctx, *args)
        if local_rank == 0:
            results.put(("result", 0, _to_bytes(value)))
        progress.at(progress.step, "leaving")
        _leave_together(dist.PrefixStore(PREFIX, store), world_size)
    except PhalanxError as e:
        # Bad input found inside a worker (or a failure it diagnosed itself, such as a server that lost
        # every worker): send the message home, then fail so the rest stop too.
        text = e.detail if isinstance(e, WorkerFailed) else str(e)
        results.put(("error", local_rank, (time.time(), type(e).__name__, text)))
        code = 3
    except BaseException:
        # Stamp the time: when one worker crashes its peers crash next ("connection closed"),
        # and the parent must name the first, not whichever it happened to notice.
        results.put(("crash", local_rank, (time.time(), traceback.format_exc())))  # the parent says it
        code = 1
    finally:
        progress.close()
        _shutdown()
    # Skip the interpreter's teardown, on success and on failure alike: a gloo thread still alive
    # (torch keeps the group referenced once DDP or a server thread used it) is ended inside a
    # noexcept C++ destructor during finalization and aborts the process ("terminate called without
    # an active exception"; see :func:`leave`). The reports went through a SimpleQueue, whose put
    # writes to the pipe before it returns, so nothing is lost.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leave_together(store: dist.Store, world_size: int, wait_s: float = 10.0) -> None:
    """Wait until every rank is done before closing connections, through the store (silently).

    Every rank counts itself out; the parent counts the ranks it saw die (an asynchronous
    strategy's lost worker). A rank that is frozen (a hung worker its server dropped) is never
    counted: the deadline lets the others leave anyway.
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


def _drain(results: Any) -> list[tuple]:
    out = []
    while not results.empty():
        out.append(results.get())
    return out


def launch(
    fn: Callable[..., Any],
    devices: Sequence[torch.device],
    args: tuple = (),
    *,
    threads: int | None = None,
    addr: str = "127.0.0.1",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    tolerate: Optional[Callable[[int], bool]] = None,
    hang_timeout_s: float = 0.0,
    label: Optional[Callable[[int], str]] = None,
    lockstep: bool = True,
) -> Any:
    """Run ``fn(ctx, *args)`` on one worker per entry of ``devices``; return rank 0's result.

    ``fn`` and ``args`` must be picklable (workers are spawned, not forked, so CUDA stays usable).
    Inside torchrun or srun this process is the worker: ``devices`` is indexed by its local rank.
    A rank for which ``tolerate(rank)`` holds may die without ending the job. With
    ``hang_timeout_s`` > 0 the parent watches every rank's progress and ends a job in which no
    rank it needs moved for that long with :class:`JobHung` naming who is stuck where. SIGTERM
    and SIGINT are passed on to the workers, which stop together at a step boundary; a second
    one stops them at once.
    """
    job = joined()
    if threads is None and all(d.type == "cpu" for d in devices):
        # Slurm says how many cores a task has (--cpus-per-task); otherwise a share of this machine's.
        threads = (job.threads if job is not None else None) or threads_per_worker(local_world_size(len(devices)))
    if job is not None:
        return _run_joined(job, fn, devices, args, threads, timeout_s)
    if len(devices) == 1:
        ctx = _init_worker(0, 1, 0, devices[0], threads, None, timeout_s)
        with _signals_to(lambda name: ctx.progress.request_stop(name)):
            return fn(ctx, *args)

    store = dist.TCPStore(addr, 0, len(devices), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    spawn = mp.get_context("spawn")
    results = spawn.SimpleQueue()
    procs = mp.start_processes(
        _spawned_worker,
        args=(fn, args, list(devices), threads, addr, store.port, timeout_s, results, hang_timeout_s > 0),
        nprocs=len(devices),
        join=False,
        start_method="spawn",
    )
    watcher = Watcher(dist.PrefixStore(PREFIX, store), len(devices), hang_timeout_s, label or (lambda r: f"rank {r}"),
                      tolerate or (lambda r: False), lockstep)
    try:
        received = _monitor(procs.processes, results, tolerate, watcher)
    finally:
        _terminate(procs.processes)  # whatever happened, no worker outlives the launch
    for kind, _rank, value in received:
        if kind == "result":
            return torch.load(io.BytesIO(value), weights_only=False)
    return None


def _monitor(processes: list, results: Any, tolerate: Optional[Callable[[int], bool]],
             watcher: Watcher) -> list[tuple]:
    """Wait for every worker; drain their reports meanwhile; on a failure or a hang stop the rest and raise.

    A rank for which ``tolerate(rank)`` is true may die without ending the job (an asynchronous
    strategy's worker: its server carries on without it). Once rank 0 has delivered its result,
    ranks that are still alive after a grace period (a frozen worker its server dropped) are
    ended. Signals received meanwhile are passed on to every worker (see :func:`_forward`).
    """
    received: list[tuple] = []
    alive = set(range(len(processes)))
    done_at: Optional[float] = None
    forward = _Forward(processes, alive)
    with _signals_to(forward):
        while alive:
            # Drain while waiting: a large result blocks its sender until the pipe is read.
            received += _drain(results)
            if done_at is None and any(kind == "result" for kind, _, _ in received):
                done_at = time.monotonic()
            mp_connection.wait([processes[r].sentinel for r in alive], timeout=0.2)
            for rank in sorted(alive):
                code = processes[rank].exitcode
                if code is None:
                    continue
                alive.discard(rank)
                if code == 0:
                    continue
                if tolerate is not None and tolerate(rank):
                    watcher.store.add("gone", 1)  # the others need not wait for it to leave
                    continue
                last_step = watcher.last_step(rank, since=time.time())  # before the others are ended
                _terminate([processes[r] for r in alive])
                received += _drain(results)
                if forward.first is not None:  # asked to stop before training began: nothing to save
                    raise Stopped(f"stopped by {forward.first} before the first step; nothing was saved",
                                  forward.first)
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                raise _failure(received, (rank, f"process {processes[rank].pid} {how}"), killed=code < 0,
                               last_step=last_step)
            raised = _expendable_that_raised(processes, alive, received, tolerate) if done_at is None else None
            if raised is not None:  # a bug (the user's model, say), not a lost machine: end the job with it
                _terminate([processes[r] for r in alive])
                raise _failure(received + _drain(results), (raised, "raised an exception"), killed=False,
                               last_step=watcher.last_step(raised))
            if done_at is not None and time.monotonic() - done_at > LEAVE_GRACE_S:
                break  # the result is home; whoever has not left by now is frozen
            if done_at is None and watcher.hung():
                report = watcher.report()
                _terminate([processes[r] for r in alive])
                raise JobHung(f"the job made no progress for {watcher.timeout:g} s (--hang-timeout): {report}")
    return received + _drain(results)


def _expendable_that_raised(processes: list, alive: set, reports: list[tuple],
                            tolerate: Optional[Callable[[int], bool]]) -> Optional[int]:
    """A rank the job may lose that reported an exception of its own (it may still be alive, stuck in
    its teardown): a killed rank reports nothing, so one that raised has a bug that must end the job.
    Not when a rank the job needs just died (a server killed makes its workers' receives fail): its
    death is the cause, and the exit check names it."""
    if tolerate is None:
        return None
    raised = [r for kind, r, _ in reports if kind in ("crash", "error") and tolerate(r)]
    if not raised:
        return None
    needed = [processes[r] for r in alive if not tolerate(r)]
    # A dying server's sentinel closes with its sockets, a moment before it can be reaped: join it.
    for sentinel in mp_connection.wait([p.sentinel for p in needed], timeout=1.0):
        next(p for p in needed if p.sentinel == sentinel).join(5.0)
    return None if any(p.exitcode not in (None, 0) for p in needed) else raised[0]


#: How long ranks may take to leave once rank 0 delivered its result.
LEAVE_GRACE_S = 15.0


class _Forward:
    """The first SIGTERM/SIGINT goes on to every worker (they stop together at a step boundary and
    save a checkpoint); a second one ends them at once."""

    def __init__(self, processes: list, alive: set):
        self.processes, self.alive = processes, alive
        self.first: Optional[str] = None

    def __call__(self, name: str) -> None:
        if self.first is not None:
            _terminate([self.processes[r] for r in self.alive])
            raise Stopped(f"stopped at once by a second {name}; checkpoints are written atomically, so the newest "
                          "one in the checkpoint directory is whole", name)
        self.first = name
        for rank in self.alive:
            if self.processes[rank].is_alive():
                os.kill(self.processes[rank].pid, getattr(signal, name))


@contextlib.contextmanager
def _signals_to(handler: Callable[[str], None]):
    """While inside, SIGTERM and SIGINT call ``handler(name)`` (in the main thread only; elsewhere nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, lambda signum, frame: handler(signal.Signals(signum).name))
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


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


def _failure(reports: list[tuple], first: tuple[int, str], killed: bool, last_step: Optional[int] = None
             ) -> PhalanxError:
    """The error to raise for a failed job.

    A worker's own PhalanxError wins (it is the user's problem, stated plainly); then a process
    killed by a signal (it could not report); then the earliest crash report; then whatever
    exited first.
    """
    errors_ = sorted((v[0], r, v[1], v[2]) for kind, r, v in reports if kind == "error")
    if errors_:
        _, rank, name, message = errors_[0]
        return _rebuild_error(rank, name, message)
    crashes = sorted((v[0], r, v[1]) for kind, r, v in reports if kind == "crash")
    if crashes and not killed:
        _, rank, tb = crashes[0]
        return WorkerFailed(rank, tb.rstrip(), step=last_step if rank == first[0] else None)
    return WorkerFailed(*first, step=last_step)


def _attempt_store(job: Joined, timeout_s: float) -> Optional[dist.Store]:
    """Under torchrun's agent store, a client of it keyed by the restart attempt (None: join by init_method).

    torchrun serves every attempt's workers the same store without an attempt prefix, so after a
    restart a fast new rank could read the gloo addresses of the dead attempt and wait forever on
    them (seen here, about one restart in three on a loaded machine). Keys of their own per attempt
    make that impossible.
    """
    if job.launcher != "torchrun" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or job.world_size < 2:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), job.world_size, is_master=False,
                           timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"phalanx/attempt_{attempt}", client)


def _run_joined(job: Joined, fn, devices, args, threads, timeout_s):
    """This process is rank ``job.rank`` of a job torchrun or srun started: join it and run ``fn``.

    torchrun passes SIGTERM (and a terminal's SIGINT reaches every rank): once training has begun
    each asks this rank to stop at the step boundary all ranks agree on, through the job's store
    (the loop installs that handler; until then the signals keep their default, immediate effect,
    since a handler cannot run while start-up is blocked inside gloo's rendezvous).
    """
    global _joined_a_group
    device = devices[job.local_rank % len(devices)]
    ctx = _init_worker(job.rank, job.world_size, job.local_rank, device, threads, _attempt_store(job, timeout_s),
                       timeout_s, job.init_method)
    _joined_a_group = ctx.distributed
    try:
        return fn(ctx, *args)
    finally:
        ctx.progress.close()
        _shutdown()


#: Whether this process was a worker of a job torchrun or srun started (see :func:`leave`).
_joined_a_group = False


def joined_a_group() -> bool:
    """Whether this process became a worker of a job torchrun or srun started (so far)."""
    return _joined_a_group


def leave(code: int) -> int:
    """The last step of the ``phalanx`` command: return ``code``, or, in a worker of a joined job,
    flush and end the process with it at once.

    Why not the interpreter's own teardown: gloo has no ``shutdown()``; its worker threads are
    joined only when the C++ process group is destroyed, and once DDP has run, torch keeps
    references to that group which Python cannot drop (``destroy_process_group`` and
    ``gc.collect()`` leave both of its threads running). A gloo thread that retires the last
    collective's work drops Python tensors and takes the GIL to do so; during interpreter
    finalization that ``pthread_exit``s the thread inside a noexcept C++ destructor, and
    ``std::terminate`` aborts a finished run ("terminate called without an active exception",
    SIGABRT; seen in 1 run of 5-15 under torchrun). Everything of ours is stopped and closed
    before this point (the watch thread joined, the prefetcher joined, the process group
    destroyed, the metrics file closed), so ending here loses nothing. The spawned workers end
    the same way (see :func:`_spawned_worker`).
    """
    if not _joined_a_group:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
