"""How workers start: as forks of one server process that imported torch once.

A spawned worker is a fresh interpreter that imports torch again (1.5 s on a 2-core machine) and
torch._dynamo, which constructing any ``torch.optim`` optimizer imports (1.2 s more): seconds per
worker, per run. Instead, multiprocessing's fork server imports them once (:data:`PRELOAD`) and
every worker is a fork of it, ready in milliseconds. The server is started early, while the
parent itself still imports torch and plans the job (:func:`start_early`, from the CLI), and it
lives as long as the parent: every later job of the same process (a comparison's runs, a script's
fits) starts its workers from it too.

Safe to fork: the server only imports (no CUDA context, no torch threads, no process group).
Not used where the workers must be children of the launching thread itself: on a shaped link
(``--link``), the thread's private network namespace is theirs only if it starts them.

Imports no torch (the CLI calls :func:`start_early` before its own torch import).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import threading
from multiprocessing import forkserver, resource_tracker

from ..comm import shaped_link
from ..errors import PhalanxError
from .startup import PAUSE_MODULE

#: Imported by the fork server before it forks anyone: first what keeps the server alive through a
#: SIGTERM sent to the whole process group (``forkserver_signals.py``), then the collector turned off for
#: the imports (``forkserver_gc.py``), then what every worker needs.
GUARD = "phalanx.launcher.forkserver_signals"
PRELOAD = [GUARD, PAUSE_MODULE, "torch", "torch._dynamo", "torch.distributed", "phalanx.launcher",
           "phalanx.train.loop", "phalanx.strategies"]

_used = False  #: whether a worker was started from the server (else it is stopped at exit: see start_early)


#: ``PHALANX_START_METHOD=spawn`` starts every worker as a fresh interpreter instead (what a
#: cold start costs, for ``benchmarks/startup.py``; or where forking is not wanted).
METHODS = ("forkserver", "spawn")


def start_method() -> str:
    """``"forkserver"`` (started now if it is not yet), or ``"spawn"`` on a shaped link or when asked."""
    global _used
    asked = os.environ.get("PHALANX_START_METHOD", "forkserver")
    if asked not in METHODS:
        raise PhalanxError(f"PHALANX_START_METHOD={asked} is not a way to start workers: use one of "
                           f"{', '.join(METHODS)}, or unset it")
    start_resource_tracker()
    if shaped_link.inside() or asked == "spawn":
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)  # (read when the server starts)
    _used = True
    return "forkserver"


def start_early() -> None:
    """Start the server now, so that its imports overlap the parent's; if no worker is ever started
    from it (a single-process run, input refused), it is stopped at exit rather than left to finish
    importing torch for nobody."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    try:
        start_resource_tracker()
        forkserver.ensure_running()
    except OSError:
        return  # (no fork server here: workers will be started however start_method says)
    atexit.register(_stop_if_unused)


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


__all__ = ["GUARD", "PRELOAD", "start_early", "start_method", "start_resource_tracker"]
