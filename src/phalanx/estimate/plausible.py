"""Whether the measurements behind an estimate can be right, before a table is built on them.

Pure: it reads measured figures and predicted speed-ups and says, in a line each, what cannot be
true. Two things give a disturbed measurement away (both seen while other work loaded the cores:
benchmarks/README.md, "Figures behind the code"):

- **a super-linear speed-up**: N workers on the same kind of device give at most N times one worker
  alone; a little more can be real (a smaller share of threads each can waste less), several times
  more means the one-worker measurement was slowed by something else;
- **a spread that swamps the mean**: step times whose standard deviation is as large as their mean
  were taken while something else came and went; their mean is no step time.

:func:`~phalanx.estimate.run.run` measures again when it finds one, and the report says it in one
line when the second measurement is no better.
"""

from __future__ import annotations

from typing import Callable, Iterable

from ..costs import Compute, Prediction
from ..units import fmt_seconds

#: a speed-up over N workers beyond N times this is implausible (up to it: threads used better, noise)
SUPERLINEAR = 1.25
#: step times whose standard deviation passes this share of their mean are implausible
SWAMPED = 1.0


def doubts(baseline: Compute, computes: dict, predictions: Iterable[Prediction],
           speedup: Callable[[Prediction], float]) -> list[str]:
    """What cannot be right in these figures, a phrase each (none: they are plausible).

    ``computes``: every measurement (Conditions -> Compute, the baseline's among them);
    ``speedup``: a prediction's examples/s over one worker alone's."""
    found = [_superlinear(p, speedup(p), baseline) for p in predictions
             if speedup(p) > SUPERLINEAR * p.workers]
    found = found[:1]  # the first says it: the rest of a table on the same baseline is as wrong
    found += [_swamped(cond, m) for cond, m in computes.items() if m.step > 0 and m.step_stdev > SWAMPED * m.step]
    return found


def _superlinear(p: Prediction, speedup: float, baseline: Compute) -> str:
    return (f"{p.strategy} on {p.workers} workers is {speedup:.1f}x one worker alone, more than {p.workers} workers "
            f"can give (one worker alone measured {fmt_seconds(baseline.step)} a step)")


def _swamped(cond, m: Compute) -> str:
    return (f"the steps of {cond.processes} process(es) x {cond.threads} thread(s) spread "
            f"{fmt_seconds(m.step_stdev)} around a mean of {fmt_seconds(m.step)}")


def warning(found: list[str]) -> str:
    """The report's one line where a second measurement was no better."""
    return (f"warning: measured twice and still implausible: {'; '.join(found)}; other work was likely loading "
            "this machine: run phalanx estimate again when it is idle")
