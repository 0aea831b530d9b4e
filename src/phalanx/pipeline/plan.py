"""The chosen partition, as the user sees it: blocks, parameters and measured time per stage."""

from __future__ import annotations

import dataclasses
from typing import Optional

from .balance import bounds, ideal_bubble, predicted_bubble, stage_costs


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

    @property
    def stages(self) -> int:
        return len(self.counts)

    def stage_seconds(self) -> Optional[list[float]]:
        return None if self.seconds is None else stage_costs(self.seconds, self.counts)

    def bubble(self) -> float:
        """Predicted idle share from the measured stage times (the ideal figure when not measured)."""
        per_stage = self.stage_seconds()
        if per_stage is None:
            return ideal_bubble(self.stages, self.micro_batches)
        return predicted_bubble(per_stage, self.micro_batches)

    def lines(self) -> list[str]:
        p, m = self.stages, self.micro_batches
        how = {"time": "by measured time", "params": "by parameter count", "explicit": "as given"}[self.how]
        out = [f"pipeline plan: {len(self.names)} blocks in {p} stages, balanced {how}; {m} micro-batches per step, "
               f"{self.schedule} schedule"]
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
        ideal = ideal_bubble(p, m)
        if per_stage is None:
            out.append(f"  predicted bubble {ideal:.1%} (equal stages: (P-1)/(M+P-1); time not measured)")
        else:
            out.append(f"  slowest stage {max(per_stage) * 1e3:.2f} ms; predicted bubble {self.bubble():.1%} "
                       f"(equal stages would give (P-1)/(M+P-1) = {ideal:.1%})")
        return out
