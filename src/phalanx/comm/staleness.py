"""Staleness statistics: how many updates behind the parameters each applied gradient was.

Two units, never mixed in one figure: a gradient's *staleness* counts updates (gradients
applied to the shared parameters between the read it was computed on and its own application);
an SSP *bound* counts steps (how far a worker's clock may lead the slowest worker's). With W
workers one step is W updates, so an honest staleness may exceed the bound in number.
"""

from __future__ import annotations

import collections
from typing import Any, Optional


class StalenessStats:
    def __init__(self, bound: Optional[int] = None):
        self.bound = bound
        self.counts: collections.Counter = collections.Counter()

    def record(self, staleness: int) -> None:
        self.counts[int(staleness)] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def percentile(self, q: float) -> int:
        """The smallest value with at least q of the samples at or below it."""
        need, seen = q * self.total, 0
        for value in sorted(self.counts):
            seen += self.counts[value]
            if seen >= need:
                return value
        return 0

    def mean(self) -> float:
        return sum(v * c for v, c in self.counts.items()) / max(self.total, 1)

    def line(self, lead: Optional[int] = None) -> str:
        """``staleness: mean 1.3, p95 3, max 4 updates behind; lead over the slowest worker at most 2 steps
        (bound 2 steps)``: each figure with its unit."""
        bound = "unbounded" if self.bound is None else f"bound {self.bound} step{'s' * (self.bound != 1)}"
        if lead is not None:
            rest = f"; lead over the slowest worker at most {lead} step{'s' * (lead != 1)} ({bound})"
        else:
            rest = f" ({bound})"
        if not self.total:
            return f"staleness: no gradients recorded{rest}"
        return (f"staleness: mean {self.mean():.1f}, p95 {self.percentile(0.95)}, max {max(self.counts)} "
                f"updates behind{rest}")

    def to_dict(self) -> dict[str, Any]:
        return {"staleness_mean": self.mean(), "staleness_p95": self.percentile(0.95),
                "staleness_max": max(self.counts, default=0), "staleness_bound": self.bound,
                "staleness_histogram": {str(k): v for k, v in sorted(self.counts.items())},
                "gradients_applied": self.total}
