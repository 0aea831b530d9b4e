"""How workers start: as forks of one server process that imported torch once.

A spawned worker is a fresh interpreter that imports torch again (1.5 s on a 2-core machine) and
torch._dynamo, which constructing any ``torch.optim`` optimizer imports (1.2 s more): seconds per
worker, per run. Instead, multiprocessing's fork server imports them once (:data:`PRELOAD`) and
every worker is a fork of it, ready in milliseconds. The command line starts the server early
(:func:`start_early`): as a fork of itself once it has imported torch and phalanx (:data:`SHARED`),
before it has run anything else, so they are imported once for both (about 2 s of CPU a job on a
2-core machine, and no wall time: the server imports the rest of :data:`PRELOAD` while the parent
plans the job). A script's ``fit()`` (or the command's ``main()`` called where torch ran before)
starts a new interpreter as the server instead: not a process to fork from. The server lives as
long as the parent: every later job of the same process (a comparison's runs, a script's fits)
starts its workers from it too. Where that process uses a model library that takes seconds to import
(:data:`MODEL_LIBRARIES`: a script that built a Hugging Face model), the server imports it too.

Safe to fork: the server only imports (no CUDA context, no torch threads, no process group), and the
command line forks it before it runs any torch operation. On a shaped link (``--link``) the server is
outside the link's network namespace: each worker joins it first (``comm/shaped_link.py``).

Imports no torch itself (:func:`start_early` does, for the command line, where nothing imported it yet).
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
import traceback
from typing import Any
from multiprocessing import connection, forkserver, resource_tracker, util

from ..comm import shaped_link
from ..errors import PhalanxError
from .startup import PAUSE_MODULE
from .stop_signals import guard_fork_server

#: Imported by the fork server before it forks anyone: first what keeps the server alive through a
#: SIGTERM sent to the whole process group (``forkserver_signals.py``), then the collector turned off for
#: the imports (``forkserver_gc.py``), then what every worker needs.
GUARD = "phalanx.launcher.forkserver_signals"
PRELOAD = [GUARD, PAUSE_MODULE, "torch", "torch._dynamo", "torch.distributed", "phalanx.launcher",
           "phalanx.train.loop", "phalanx.strategies"]

#: Model libraries whose import takes seconds in each worker that unpickles a model of theirs (a Hugging Face model's
#: class imports transformers' modeling machinery: 2.4 to 3.4 s of CPU a worker on a 2-core machine): top-level package
#: -> the module to import. Where the process starting the server has imported the package, the server imports the
#: module too (:data:`MODELS`, which leaves any error to the workers to meet).
MODEL_LIBRARIES = {"transformers": "transformers.modeling_utils"}
MODELS = "phalanx.launcher.forkserver_models"

#: What the command line imports in any case, imported before the server forks from it; the server imports
#: the rest (torch._dynamo, which constructing a ``torch.optim`` optimizer imports: the parent constructs one
#: only to check a user's factory, see :func:`start_early`) while the parent plans.
SHARED = [name for name in PRELOAD if name not in (GUARD, PAUSE_MODULE, "torch._dynamo")]

_used = False  #: whether a worker was started from the server (else it is stopped at exit: see start_early)


#: ``PHALANX_START_METHOD=spawn`` starts every worker as a fresh interpreter instead (what a
#: cold start costs, for ``benchmarks/startup.py``; or where forking is not wanted).
METHODS = ("forkserver", "spawn")


#: What a run of some kind imports in each worker, seconds of CPU a worker on a 2-core machine, imported by the server
#: once for them all where the run is known to be of that kind when the server starts: a model split by tracing runs
#: torch.export (0.3 s), and ``--compile`` inductor (1.5 s, and as much of each worker's start-up).
TRACING, COMPILING = "torch.export._trace", "torch._inductor.compile_fx"


def preload(traces: bool = False, compiles: bool = False) -> list[str]:
    """What a server started now imports: :data:`PRELOAD`; each of :data:`MODEL_LIBRARIES` this process has imported
    (a script's or a notebook's ``fit()`` on a model it built), so a job's workers fork with it imported; torch.export
    for a run that ``traces`` (a pipeline's, or one whose parent rehearsed a traced split: it is imported here), and
    inductor for a run that ``compiles``."""
    libraries = [MODELS] if any(package in sys.modules for package in MODEL_LIBRARIES) else []
    tracing = [TRACING] if traces or TRACING in sys.modules else []
    return PRELOAD + libraries + tracing + ([COMPILING] if compiles else [])


def start_method(compiles: bool = False) -> str:
    """``"forkserver"`` (started now if it is not yet, importing inductor too for a job that ``compiles``), or
    ``"spawn"`` when asked."""
    global _used
    asked = os.environ.get("PHALANX_START_METHOD", "forkserver")
    if asked not in METHODS:
        raise PhalanxError(f"PHALANX_START_METHOD={asked} is not a way to start workers: use one of "
                           f"{', '.join(METHODS)}, or unset it")
    start_resource_tracker()
    if asked == "spawn":
        return "spawn"
    multiprocessing.set_forkserver_preload(preload(compiles=compiles))  # (read when the server starts)
    with shaped_link.outside():  # (the server outlives a shaped link's job: not in its namespace)
        forkserver.ensure_running()
    _used = True
    return "forkserver"


def start_early(fork: bool, builds_an_optimizer: bool = False, traces: bool = False, compiles: bool = False) -> None:
    """Start the server now, from the command line: with ``fork`` (a process that has run nothing of torch's yet
    and has no other thread), import :data:`SHARED` and fork the server from this process, so that the server's
    other imports overlap the parent's planning; else as a new interpreter. ``builds_an_optimizer``: this process
    will construct one (to check the user's optimizer or scheduler factory), which imports torch._dynamo, so it
    imports that first too, once for both. ``traces`` and ``compiles``: the run may split its model by tracing (a
    pipeline), or compiles it (see :func:`preload`). If no worker is ever started from it (a single-process run,
    input refused), it is stopped at exit rather than left importing for nobody."""
    modules = preload(traces, compiles)
    multiprocessing.set_forkserver_preload(modules)
    shared = SHARED + ["torch._dynamo"] if builds_an_optimizer else SHARED
    try:
        start_resource_tracker()
        if not (fork and not _cuda_is_initialized() and _fork_server(shared, modules)):
            forkserver.ensure_running()
    except OSError:
        return  # (no fork server here: workers will be started however start_method says)
    atexit.register(_stop_if_unused)


def fork_loader_server(modules: list[str]) -> None:
    """In a worker forked from the server whose DataLoader workers will read a Dataset (``--loader-workers``),
    before it starts any thread: their fork server, forked from this worker now (torch and phalanx are imported;
    the server imports the Dataset's ``modules``) rather than started as a new interpreter that imports torch again
    when the first batch is read. Nothing where it cannot be forked (another thread running, Python 3.14's
    authenticated server): it then starts as a new interpreter at the first batch."""
    _fork_server([], modules)


def _fork_server(imports: list[str], preload: list[str]) -> bool:
    """multiprocessing's fork server, forked from this process after it imported ``imports`` rather than started as a
    new interpreter that imports them again; the server then imports ``preload`` (after the guard: see :func:`_serve`).
    False where it cannot be forked: another thread runs here (a fork may copy a lock it holds), or
    multiprocessing's server takes an authentication key (Python 3.14) and must be a new interpreter."""
    server: Any = forkserver._forkserver  # (its state, as its own ensure_running sets it)
    if threading.active_count() != 1 or hasattr(server, "_forkserver_authkey"):
        return False
    if server._forkserver_pid is not None:
        return True
    for name in imports:
        importlib.import_module(name)
    # (not under the server's lock, which a fork would copy held into the server and every worker: a rank's
    # loader fork server waited for it forever; this process has no other thread)
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # (EOF on alive_r: every client is gone, and the server ends)
        # (else what this process printed so far, still buffered, every worker would print again)
        util._flush_std_streams()  # type: ignore[attr-defined]
        pid = os.fork()
        if pid == 0:
            _serve(listener.fileno(), alive_r, alive_w, preload)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return True


def _serve(listener_fd: int, alive_r: int, alive_w: int, preload: list[str]) -> None:
    """In the forked server: the guard first (what importing :data:`GUARD` does, done here too: a worker forking its
    loader workers' server imported it long before), then multiprocessing's server loop, which imports ``preload``
    (what is imported already is not imported again); it never returns into the parent's code."""
    status = 0
    try:
        os.close(alive_w)
        guard_fork_server()
        forkserver.main(listener_fd, alive_r, preload)
    except (SystemExit, KeyboardInterrupt):  # (its end: the parent is gone; or a Ctrl-C before its guard was in)
        pass
    except BaseException:
        traceback.print_exc()
        status = 1
    os._exit(status)


def _cuda_is_initialized() -> bool:
    """Whether this process holds a CUDA context (the user's module, imported by the command before the server forks,
    may have made one): a worker forked from it could not use CUDA (a loader worker, which does not, may)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (if it is not running) with SIGHUP ignored, a disposition a new
    program keeps. It ignores SIGINT and SIGTERM itself, not SIGHUP: a closed terminal killed it, the parent,
    stopping at a step, started another, and that one printed a traceback for every semaphore it was told to
    forget (it had never heard of them)."""
    if threading.current_thread() is not threading.main_thread():  # (only the main thread may set handlers)
        resource_tracker.ensure_running()
        return
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, previous)


def _stop_if_unused() -> None:
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not _used and pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


__all__ = ["GUARD", "MODEL_LIBRARIES", "MODELS", "PRELOAD", "SHARED", "fork_loader_server", "preload", "start_early",
           "start_method", "start_resource_tracker"]
