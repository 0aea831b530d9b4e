"""How the launcher takes a stop request (SIGTERM, SIGINT, SIGHUP: :mod:`.stop_signals`), wherever it arrived.

A request reaches the job in one of three ways, and all three must end alike (every worker stops
at one step and saves it; exit 143, 130 or 129):

- the launcher gets the signal (``kill PID``): :class:`Forward` passes it on to every worker;
- the whole process group gets it (a terminal's Ctrl-C, Slurm, Kubernetes): the workers have it
  already, and the launcher's copy is the same request (a worker counts signals within
  :data:`~phalanx.launcher.watch.SAME_REQUEST_S` as one);
- one worker gets it: past its first step it publishes the request in the job's store (see
  ``train/stop.py``); before it, it ends at once with status 128 + the signal
  (:meth:`phalanx.launcher.watch.Progress.handle_signals`), and the launcher reads that exit as the job's
  request (:meth:`Forward.worker_stopped`), not as a failure: the others may have failed in a
  collective with it by then, and their gloo tracebacks would blame a rank nobody signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable, Optional

from ..errors import Stopped
from .stop_signals import STOP_CODES, STOP_SIGNALS, asked, pass_on
from .watch import SAME_REQUEST_S


class Forward:
    """The first SIGTERM/SIGINT/SIGHUP goes on to every worker (they stop together at a step boundary and
    save a checkpoint); a second one ends them at once (``end_now``) and raises :class:`Stopped`."""

    def __init__(self, processes: list, alive: set, end_now: Callable[[list], None], label: Callable[[int], str]):
        self.processes, self.alive, self.end_now, self.label = processes, alive, end_now, label
        self.first: Optional[str] = None  #: the signal that asked the job to stop
        self.ended_at_once: Optional[int] = None  #: a rank that ended at once on it, before its first step
        self._echo_until = 0.0  #: until then, our own copy of a worker's signal is that same request

    def __call__(self, name: str) -> None:
        if self.first is not None and time.monotonic() < self._echo_until:
            return  # the process group's signal, reaching us a moment after the worker it ended
        if self.first is not None:
            self.end_now([self.processes[r] for r in self.alive])
            raise Stopped(f"stopped at once by a second {name}; checkpoints are written atomically, so the newest "
                          "one in the checkpoint directory is whole", name)
        self._ask_everyone(name)

    def worker_stopped(self, rank: int, code: int) -> None:
        """Worker ``rank`` ended with ``code``, one of :data:`STOP_CODES`: it was signalled before its first
        step. That is the job's stop request, as if the launcher had been signalled."""
        self.ended_at_once = rank if self.ended_at_once is None else self.ended_at_once
        if self.first is None:
            self._echo_until = time.monotonic() + SAME_REQUEST_S
            # (asked by SIGTERM whatever the signal: a worker started as a fresh interpreter may still be importing,
            # where a SIGINT is a KeyboardInterrupt and its traceback, a SIGTERM an end without a word; no step can
            # be saved together now, so the signal a worker stops by names nothing the user sees)
            self._ask_everyone(STOP_CODES[code], signal.SIGTERM)

    def _ask_everyone(self, name: str, sent: Optional[int] = None) -> None:
        self.first = name
        for rank in self.alive:
            if self.processes[rank].is_alive():
                os.kill(self.processes[rank].pid, sent or getattr(signal, name))

    def explains_failure(self, steps_made: bool) -> bool:
        """Whether a worker's failure now is the stop's doing, not a fault: a stop was requested and either
        no step was made (a rank blocked in start-up fails in gloo when its peers end at once) or a rank
        ended at once on it (the others' next collective fails without it)."""
        return self.first is not None and (not steps_made or self.ended_at_once is not None)

    def stopped(self, steps_made: bool) -> Stopped:
        """The stop, for a job that ended without stopping together at one step (a stop was asked:
        :meth:`explains_failure`)."""
        assert self.first is not None, "asked only once a stop was requested"
        if not steps_made:
            return Stopped(f"stopped by {self.first} before the first step; nothing was saved", self.first)
        why = "every worker ended before they could stop together at a step" if self.ended_at_once is None else \
            f"{self.label(self.ended_at_once)} had not begun its first step and ended at once, so no step could be " \
            "saved together"
        return Stopped(f"stopped by {self.first}: {why}; checkpoints are written atomically, so the newest one in the "
                       "checkpoint directory is whole", self.first)


@contextlib.contextmanager
def signals_to(handler: Callable[[str], None]):
    """While inside, SIGTERM, SIGINT and SIGHUP call ``handler(name)`` (in the main thread only; elsewhere nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    taken: list[str] = []

    def take(signum: int, frame: object) -> None:
        taken.append(signal.Signals(signum).name)
        handler(taken[-1])

    for sig in previous:
        signal.signal(sig, take)
    try:
        early = asked()
        if early is not None:  # a request the caller recorded before this launch took over (compare's)
            handler(early)
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if taken:  # (the caller stops between its launches: estimate's measurements, compare's runs)
            pass_on(taken[0])


__all__ = ["Forward", "STOP_CODES", "signals_to"]
