"""DiLoCo: local steps with the run's optimizer, then an outer Nesterov step on the averaged pseudo-gradient.

DiLoCo (Douillard et al. 2023) and streaming DiLoCo (Douillard et al. 2025). Every worker keeps
two copies of the parameters: its **local** weights, which the run's optimizer (the *inner*
optimizer) steps on its own shard, and the **global** weights, equal on every rank, kept apart
(on the CPU: pinned memory beside a GPU, a separate copy beside the CPU). Every H steps:

    pseudo-gradient = global - local               (on every rank)
    averaged        = all-reduce mean over ranks   (the only communication)
    global          = outer SGD step(averaged)     (lr --outer-lr, Nesterov momentum --outer-momentum)
    local           = global                       (the inner optimizer state stays local)

With ``--fragments F`` (streaming DiLoCo) the parameters are cut into F contiguous fragments of
about equal size; fragment f goes through the same round at its own staggered steps, so each
sync sends 1/F of the model. Rounds are counted as torch's ``PeriodicModelAverager`` counts them
(a fragment with offset 0 syncs after steps 1, H+1, 2H+1, ...), so with outer lr 1 and no momentum
DiLoCo is exactly local-sgd. The run ends (:meth:`DiLoCoRuntime.finish`, after its last step or
at a target) with an outer round of every fragment that took a local step since its last round,
whether H divides the steps or not, so the global model holds every step's work and every rank holds
it. A stop (a signal) leaves that round owed: its checkpoint holds the global model, every rank's local
model and inner optimizer, and the fragments that owe a round (``replica_state.py``), so a resume on
the same worker count continues exactly. Buffers (BatchNorm's running statistics) are not
pseudo-gradients: they are averaged over the ranks with fragment 0's rounds (integer step counts:
rank 0's) and kept as the global model's, which is what is evaluated and saved. ``--outer-precision``
sets the pseudo-gradient on the
wire (see :func:`average`); the outer step is always fp32. When a worker dies, the survivors run an outer
round of every fragment that owes one over a group of their own (``launcher/survivors.py``: their
pseudo-gradients averaged, the lost worker's local steps since its last round lost with it), and one of them
saves the global model it gives.
"""


from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...errors import PhalanxError
from ...options import option
from ..base import Build, Runtime
from ..options import Options
from ..layout import Job, Layout, data_parallel
from ..registry import register
from .costs import DiLoCoCost
from .outer import PRECISIONS, fragment_bounds
from .runtime import DiLoCoRuntime
from .simulated import DILOCO

#: the DiLoCo paper's outer momentum and worker count (Douillard et al. 2023: 8 workers, Nesterov 0.9)
PAPER_MOMENTUM, PAPER_WORKERS = 0.9, 8


@dataclasses.dataclass(frozen=True)
class DiLoCo(Options):
    name: ClassVar[str] = "diloco"
    one_piece_backward: ClassVar[bool] = True
    survivors_save: ClassVar[bool] = True
    checkpoints_activations: ClassVar[bool] = True
    sharded_checkpoints: ClassVar[bool] = True  # each replica's own state, by rank (replica_state.py)
    summary: ClassVar[str] = ("H local steps, then the averaged pseudo-gradient applied by an outer Nesterov SGD; "
                              "streaming fragments")

    sync_every: int = option(8, "sync every H inner optimizer steps")
    # Not the paper's 0.7 with Nesterov momentum 0.9: made for 8 workers, on 2 it overshoots (digits, 300 steps,
    # 3 seeds: the cnn at chance or diverged, lstm 0.59-0.78); without momentum every built-in model trains
    # (cnn 0.978-0.994, mlp 0.972-0.978, lstm 0.961-0.972). docs/diloco.md has the measurement.
    outer_lr: float = option(0.7, "the outer SGD's learning rate on the averaged pseudo-gradient")
    outer_momentum: float = option(0.0, "the outer SGD's Nesterov momentum (0: plain SGD; the paper's 0.9 needs "
                                        "many workers)")
    fragments: int = option(1, "streaming: split the parameters into F fragments synced at staggered steps")
    outer_precision: str = option("fp32", "the pseudo-gradient on the wire (reduced and applied in fp32)",
                                  choices=PRECISIONS)

    def __post_init__(self) -> None:
        if not isinstance(self.sync_every, int) or isinstance(self.sync_every, bool) or self.sync_every < 1:
            raise PhalanxError(f"--sync-every must be at least 1 step, got {self.sync_every!r}")
        if not self.outer_lr > 0:
            raise PhalanxError(f"--outer-lr must be positive, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise PhalanxError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if not isinstance(self.fragments, int) or isinstance(self.fragments, bool) or self.fragments < 1:
            raise PhalanxError(f"--fragments must be at least 1, got {self.fragments!r}")
        if self.fragments > self.sync_every:
            raise PhalanxError(f"--fragments {self.fragments} is more than --sync-every {self.sync_every}: each "
                               f"fragment syncs at its own step of every {self.sync_every}; use --fragments "
                               f"{self.sync_every} or fewer")
        if self.outer_precision not in PRECISIONS:
            raise PhalanxError(f"unknown --outer-precision {self.outer_precision!r}: choose {', '.join(PRECISIONS)}")

    def describe(self) -> str:
        momentum = f"Nesterov momentum {self.outer_momentum:g}" if self.outer_momentum else "no momentum"
        extra = f", {self.fragments} fragments" if self.fragments > 1 else ""
        wire = f", {self.outer_precision} pseudo-gradients" if self.outer_precision != "fp32" else ""
        return f"diloco (sync every {self.sync_every} steps, outer lr {self.outer_lr:g}, {momentum}{extra}{wire})"

    def header_notes(self, workers: int) -> list[str]:
        """The run header's word where the outer momentum is the paper's and the workers are few."""
        if self.outer_momentum < PAPER_MOMENTUM or workers >= PAPER_WORKERS:
            return []
        return [f"diloco: outer Nesterov momentum {self.outer_momentum:g} is the paper's setting, for {PAPER_WORKERS} "
                f"workers or more; on {workers} it overshoots (digits, 2 workers: the cnn at chance); --outer-momentum "
                "0, the default, trains every built-in model"]

    def layout(self, job: Job) -> Layout:
        if job.model is not None:
            fragment_bounds([p.numel() for p in job.model.parameters()], self.fragments)
        return dataclasses.replace(data_parallel(job), drift=self.sync_every)  # (ranks meet at each outer round)

    def runtime(self, build: Build) -> Runtime:
        return DiLoCoRuntime(build, self)


# Its cost model, for phalanx estimate (costs.py); its simulated rule, for compare --simulate (simulated.py).
register(DiLoCo, cost=DiLoCoCost(), simulated=DILOCO)
