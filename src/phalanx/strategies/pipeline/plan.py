"""The chosen partition, as the user sees it: blocks, parameters, measured time and what it predicts.

Pure: built from the measurements every rank agreed on, so every rank holds the same plan.
:meth:`StagePlan.step_seconds` prices any partition of the same blocks (``counts``), which is how
the plan can say what it gains over another split (the benchmark compares against the equal one).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from ..balance import bounds, ideal_bubble, predicted_bubble, predicted_step, stage_costs


@dataclasses.dataclass
class StagePlan:
    """Which blocks each stage holds, and what that predicts."""

    counts: tuple[int, ...]  #: blocks per stage
    names: list[str]  #: every block's name in the model
    params: list[int]  #: parameters per block
    seconds: Optional[list[float]]  #: forward+backward seconds per block and micro-batch (None: not measured)
    how: str  #: "time", "params" or "explicit"
    micro_batches: int  #: M
    schedule: str  #: gpipe | 1f1b
    replicas: int = 1  #: data-parallel copies of the pipeline (rank = stage x replicas + replica)
    #: one-way seconds of the message a cut after each block sends per micro-batch (None: not measured)
    message: Optional[list[float]] = None
    output_bytes: Optional[list[int]] = None  #: bytes of each block's output per micro-batch
    conditions: str = ""  #: how the times were measured, as printed
    #: the model split by tracing: the submodules where stages 1.. begin (empty: cut at its blocks)
    traced: tuple = ()
    users_step: bool = False  #: the traced step is the user's (--training-step): its Python runs once, at the trace

    @property
    def stages(self) -> int:
        return len(self.counts)

    def boundary(self) -> Optional[list[float]]:
        """Per block: what a cut after it costs each stage beside it per micro-batch (activations one
        way, their gradients the other)."""
        return None if self.message is None else [2 * s for s in self.message]

    def stage_seconds(self, counts: Optional[Sequence[int]] = None, messages: bool = False) -> Optional[list[float]]:
        """Seconds per micro-batch of every stage (its blocks; with ``messages``, its boundaries too)."""
        if self.seconds is None:
            return None
        return stage_costs(self.seconds, counts or self.counts, self.boundary() if messages else None)

    def cut_latency(self, counts: Optional[Sequence[int]] = None) -> list[float]:
        """One-way seconds of the message at every cut (the fill and drain cross each once per direction)."""
        if self.message is None:
            return []
        return [self.message[hi - 1] for _, hi in bounds(counts or self.counts)[:-1]]

    def step_seconds(self, counts: Optional[Sequence[int]] = None) -> Optional[float]:
        """Predicted seconds of one step's schedule under ``counts`` (default: this plan's partition)."""
        per_stage = self.stage_seconds(counts, messages=True)
        if per_stage is None:
            return None
        return predicted_step(per_stage, self.micro_batches, self.cut_latency(counts))

    def speedup_over(self, counts: Sequence[int]) -> Optional[float]:
        """Predicted step time of ``counts`` over this plan's: how much faster this plan should run."""
        mine, other = self.step_seconds(), self.step_seconds(counts)
        return None if mine is None or other is None or mine <= 0 else other / mine

    def bubble(self) -> float:
        """Predicted idle share from the measured stage times (the ideal figure when not measured)."""
        per_stage = self.stage_seconds(messages=True)
        if per_stage is None:
            return ideal_bubble(self.stages, self.micro_batches)
        return predicted_bubble(per_stage, self.micro_batches, self.cut_latency())

    def lines(self) -> list[str]:
        p, m = self.stages, self.micro_batches
        how = {"time": "by measured time", "params": "by parameter count", "explicit": "as given"}[self.how]
        out = [f"pipeline plan: {len(self.names)} blocks in {p} stages, balanced {how}; {m} micro-batches per step, "
               f"{self.schedule} schedule"]
        if self.traced:
            among = "as given" if self.how == "explicit" else f"{how}, among {len(self.names) - 1} repeated blocks"
            out[0] = (f"pipeline plan: the training step traced (torch.export) and split at {', '.join(self.traced)} "
                      f"into {p} stages ({among}); {m} micro-batches per step, {self.schedule} schedule")
            if self.users_step:
                out.append("  your training step runs once, when traced (and once per evaluation batch shape): every "
                           "step runs the graph it recorded, so its Python (a counter, a print, a branch on a step "
                           "count) does not run again")
        per_stage = self.stage_seconds()
        r = self.replicas
        if r > 1:
            out.append(f"  mesh: {p} stages x {r} replicas = {p * r} ranks (rank = stage x {r} + replica); each "
                       f"replica reads its own data shard, each stage's {r} replicas average their gradients")
        for s, (lo, hi) in enumerate(bounds(self.counts)):
            blocks = self.names[lo] if hi - lo == 1 else f"{self.names[lo]}..{self.names[hi - 1]}"
            timing = "" if per_stage is None else f", {per_stage[s] * 1e3:.2f} ms per micro-batch (fwd+bwd)"
            ranks = f"rank {s}" if r == 1 else f"ranks {', '.join(str(s * r + k) for k in range(r))}"
            out.append(f"  stage {s} ({ranks}): blocks {blocks} ({hi - lo}), "
                       f"{sum(self.params[lo:hi]):,} parameters{timing}")
        out += self._boundary_lines()
        ideal = ideal_bubble(p, m)
        with_messages, step = self.stage_seconds(messages=True), self.step_seconds()
        if per_stage is None or with_messages is None or step is None:  # (all three, or none: the blocks' times)
            out.append(f"  predicted bubble {ideal:.1%} (equal stages: (P-1)/(M+P-1); time not measured)")
            return out
        slowest = max(with_messages)
        out.append(f"  slowest stage {slowest * 1e3:.2f} ms per micro-batch with its messages; predicted step "
                   f"{step * 1e3:.1f} ms, predicted bubble {self.bubble():.1%} "
                   f"(equal stages would give (P-1)/(M+P-1) = {ideal:.1%})")
        if self.conditions:
            out.append(f"  measured {self.conditions}")
        return out

    def _boundary_lines(self) -> list[str]:
        if self.message is None or self.output_bytes is None:
            return []
        out = []
        for s, (_, hi) in enumerate(bounds(self.counts)[:-1]):
            kib = self.output_bytes[hi - 1] / 1024
            out.append(f"  stage {s} -> {s + 1}: {kib:,.0f} KiB of activations per micro-batch (and their gradients "
                       f"back), {self.message[hi - 1] * 1e3:.2f} ms per message")
        return out
