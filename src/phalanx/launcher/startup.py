"""Where a run's first seconds go: its start-up phases, timed from the moment the command began.

The parent marks when the command began (:func:`begin`, first thing in the CLI; each
``Trainer.fit`` takes that mark, or, in a process that fits again, its own call's time) and when its
plan was ready; rank 0 marks when its process group was
joined and then each phase of its own preparation. The summary and the metrics file hold the
marks (``startup_seconds``: seconds since the command began, per phase, in order); under
``--profile-startup`` rank 0 prints them as one line. Wall-clock times (``time.time()``), since
the marks are taken in different processes.

The workers' fork server imports without the cyclic garbage collector. Importing torch, torch._dynamo (which
any ``torch.optim`` optimizer imports) and phalanx makes some 300,000 objects that live as long as the
process, and the collector, set off by those allocations, walks them again and again: about a tenth of the
server's import time on the 2-core machine (figures in benchmarks/README.md, "Start-up"), on the path to the
first step. So the server turns the collector off before it imports (``forkserver_gc.py``) and each process
forked from it freezes what it inherited and turns the collector on, first thing (:func:`resume_collector`):
the recipe of Python's documentation for a process that forks without exec (``gc.freeze``). Frozen objects
are never walked again, so a worker's collections neither spend time on them nor write to the pages it
shares with the server. What goes uncollected is the imports' few cyclic leftovers (some 9,000 objects), once.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Optional

#: The phases, in order, and what each one ends.
PHASES = {
    "plan": "imports and the parent's checks",
    "joined": "workers started and joined the process group",
    "data": "data loaded",
    "model": "model built",
    "calibration": "straggler calibration",
    "strategy": "strategy set up (wrappers, first broadcast)",
    "first_step": "first training step",
}

_began: Optional[float] = None  #: when the CLI command began, until a run takes it


def begin() -> None:
    """The command begins now (the CLI's first line)."""
    global _began
    _began = time.time()


def run_began() -> float:
    """When this run began: the command's beginning for its first run, now for any later one."""
    global _began
    began, _began = (_began if _began is not None else time.time()), None
    return began


class Marks:
    """Phase -> seconds since the command began, in the order they were reached."""

    def __init__(self, began: float, **already: float):
        self.began = began
        self.seconds: dict[str, float] = dict(already)

    def mark(self, phase: str) -> None:
        """The phase ended now; only its first mark counts (the loop marks the first step on every step,
        so a later one costs a dict lookup, nothing more)."""
        if phase not in self.seconds:
            assert phase in PHASES, phase
            self.seconds[phase] = round(time.time() - self.began, 4)

    def line(self) -> str:
        """``start-up 2.41 s to the first step: imports and the parent's checks 1.52 s, workers ... +0.61 s, ...``"""
        parts: list[str] = []
        before = 0.0
        for phase, at in self.seconds.items():
            parts.append(f"{PHASES[phase]} {'+' if parts else ''}{at - before:.2f} s")
            before = at
        total = self.seconds.get("first_step", before)
        return f"start-up {total:.2f} s to the first step: " + ", ".join(parts)


#: imported by the workers' fork server before anything else it imports: turns the collector off there
PAUSE_MODULE = "phalanx.launcher.forkserver_gc"


def resume_collector() -> None:
    """First thing in a process forked from a fork server that imported with the collector off: what it
    imported is frozen, and the collector runs for what this process makes. Nothing elsewhere (a spawned
    worker, a program that turned the collector off itself)."""
    if PAUSE_MODULE in sys.modules and not gc.isenabled():
        gc.freeze()
        gc.enable()


__all__ = ["Marks", "PAUSE_MODULE", "PHASES", "begin", "resume_collector", "run_began"]
