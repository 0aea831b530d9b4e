"""The signals that ask a phalanx process to stop, and how one is taken where stopping is safe.

Three signals mean "stop, and keep what is done": SIGTERM (Slurm's and Kubernetes' stop, ``kill``), SIGINT
(a terminal's Ctrl-C) and SIGHUP (a terminal closed, an ssh session dropped). Everywhere one is handled, all
three are, alike; a process stopped by one ends with 128 + its number (143, 130, 129), as a shell reports it.

Two rules hold for every handler here:

- **From the first instruction.** A worker forked from the fork server would otherwise inherit the server's
  dispositions until it installs its own: SIGTERM and SIGHUP ignored (the server must outlive a stop sent to
  the whole process group), SIGINT a ``KeyboardInterrupt`` raised anywhere. :func:`guard_fork_server` gives the
  server a handler that ignores them in the server itself and, in any process forked from it, records the
  first one (:func:`taken_early`), which the worker acts on as soon as it installs its own handlers.
- **Taken where it is safe.** A handler that raises lands in whatever code runs at that instant, and any
  ``except Exception`` there (a fallback around torch's vmap, a user's model) swallows it. So the first request
  is recorded (:func:`asked`) and raised where stopping is safe (:func:`stop_if_asked`: between runs, at a
  simulated step); only a second one raises at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator, Optional

#: Each one asks for a stop at a step boundary with what is done saved.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: The exit status of a process that ended at once on a stop signal, and the signal's name; negative: killed by
#: one before it had any handler (a worker started as a fresh interpreter, ``PHALANX_START_METHOD=spawn``).
STOP_CODES = {**{128 + int(s): s.name for s in STOP_SIGNALS}, **{-int(s): s.name for s in STOP_SIGNALS}}

_server_pid: Optional[int] = None  #: in a fork server and the processes forked from it: the server's pid
_early: Optional[int] = None  #: a stop signal that reached a forked process before its own handlers


def guard_fork_server() -> None:
    """In a fork server, before it forks anyone: the server ignores the stop signals (a stop sent to the whole
    process group must not end it; multiprocessing would report every child of a dead server as failed), and
    a process forked from it records the first one that reaches it before its own handlers are installed."""
    global _server_pid
    _server_pid = os.getpid()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record_early)


def _record_early(signum: int, frame: object) -> None:
    global _early
    if os.getpid() != _server_pid and _early is None:
        _early = signum


def record_until_ready() -> None:
    """In a worker, first thing: where no fork server's handler is inherited (a spawned worker), record a stop
    signal from here on as a forked worker does from its first instruction."""
    global _server_pid
    if _server_pid is None and threading.current_thread() is threading.main_thread():
        _server_pid = 0
        for sig in STOP_SIGNALS:
            signal.signal(sig, _record_early)


def taken_early() -> Optional[int]:
    """The stop signal that reached this process before its own handlers, if any (see :func:`guard_fork_server`)."""
    return _early


#: ``RANK:SIGNAL`` (e.g. ``1:SIGTERM``): worker RANK sends itself SIGNAL the moment it appears, before its own
#: handlers, so that a test can stop a worker there without racing its start-up.
SIGNAL_AT_START = "PHALANX_SIGNAL_AT_START"


def signal_self_at_start(rank: int) -> None:
    """In worker ``rank``, as soon as it has the parent's environment (a forked worker's is the fork server's until
    then, which a later job's parent may have changed) and before its own handlers: :data:`SIGNAL_AT_START`'s
    signal, if it names this rank."""
    asked_for = os.environ.get(SIGNAL_AT_START, "")
    if asked_for.partition(":")[0] == str(rank):
        os.kill(os.getpid(), getattr(signal, asked_for.partition(":")[2]))


_asked: Optional[str] = None  #: the first stop signal while :func:`taken_between_steps` is in force
_between_steps = False  #: whether :func:`taken_between_steps` is in force


def asked() -> Optional[str]:
    return _asked


def pass_on(name: str) -> None:
    """A stop request a launcher's own handlers took (inside :func:`taken_between_steps`) is the caller's too:
    workers that do not stop for it (a measurement's, a run that had just ended) end as if it had not come."""
    global _asked
    if _between_steps and _asked is None:
        _asked = name


def stop_if_asked() -> None:
    """Raise :class:`~phalanx.errors.Stopped` if a stop was asked: called where stopping is safe."""
    from ..errors import Stopped

    if _asked is not None:
        raise Stopped(f"stopped by {_asked}", _asked)


@contextlib.contextmanager
def taken_between_steps() -> Iterator[None]:
    """While inside (main thread only), a stop signal is recorded for :func:`stop_if_asked`; a second one raises
    :class:`~phalanx.errors.Stopped` at once. Inside, a launcher's own handlers take over and restore these."""
    global _asked
    from ..errors import Stopped

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        global _asked
        name = signal.Signals(signum).name
        if _asked is not None:
            raise Stopped(f"stopped at once by a second {name}", _asked)
        _asked = name

    global _between_steps
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    _asked, _between_steps = None, True
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _asked, _between_steps = None, False


__all__ = ["STOP_CODES", "STOP_SIGNALS", "asked", "guard_fork_server", "pass_on", "record_until_ready",
           "signal_self_at_start", "stop_if_asked", "taken_between_steps", "taken_early"]
