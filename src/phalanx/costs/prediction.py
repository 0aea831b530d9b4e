"""One predicted row: a strategy on N workers, its step time and where the time goes."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Prediction:
    strategy: str
    workers: int
    nodes: int
    step: float  #: seconds per global step
    examples: int  #: examples per global step
    compute: float  #: seconds of the step spent computing on the critical path
    ideal: float  #: the step of independent workers: the same compute, no communication, no bubble
    bubble: float = 0.0  #: seconds a pipeline's stages stand idle (fill and drain)
    notes: tuple[str, ...] = ()  #: how the figure was reached, in words
    parts: dict = dataclasses.field(default_factory=dict)  #: seconds per named part, for --json

    @property
    def examples_per_s(self) -> float:
        return self.examples / self.step if self.step > 0 else 0.0

    @property
    def efficiency(self) -> float:
        """The share of independent workers' throughput reached (1.0: nothing lost to communication or bubbles)."""
        return min(1.0, self.ideal / self.step) if self.step > 0 else 1.0

    @property
    def comm(self) -> float:
        """Seconds of the step spent communicating, after overlap (and waiting for a shared CPU)."""
        return max(0.0, self.step - self.compute - self.bubble)

    @property
    def comm_share(self) -> float:
        return self.comm / self.step if self.step > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "workers": self.workers, "nodes": self.nodes, "step_s": self.step,
                "examples_per_step": self.examples, "examples_per_s": self.examples_per_s,
                "efficiency": self.efficiency, "compute_s": self.compute, "comm_exposed_s": self.comm,
                "comm_share": self.comm_share, "bubble_s": self.bubble, "ideal_s": self.ideal,
                "parts_s": dict(self.parts), "notes": list(self.notes)}
