"""The server's aggregation rule, as pure logic: which gradients make one update, weighed how.

The server holds the gradients it has taken but not yet applied; a rule says

- whether it takes a gradient at all (:meth:`admits`: one computed on parameters older than the
  current ones may be dropped),
- how many it needs before they become one update (:meth:`quorum`, given the live workers),
- how that update weighs their sum (:meth:`weight`),
- and how many updates make one global step (:attr:`per_step`).

Two rules, one mechanism:

- :class:`Asynchronous` (``ps``, ``ssp`` with K > 0): every gradient is an update of its own, taken
  whatever its version, scaled by 1/W; W updates are one global step.
- :class:`Rounds` (``backup`` with B backup workers; ``ssp`` with K = 0 is ``Rounds`` with B = 0):
  an update averages the first W − B gradients computed on the current parameters; a gradient
  computed on older ones arrives too late and is dropped; one update is one global step. A lost
  worker first uses up a backup's place (W − B are still awaited while W − B live), then the
  quorum is every live worker. With B = 0 and every worker alive an update averages all W
  gradients of the step: exactly what ``sync`` computes (Chen et al., 2016, "Revisiting
  Distributed Synchronous SGD"; TensorFlow 1's ``SyncReplicasOptimizer``).
"""

from __future__ import annotations


class Asynchronous:
    """Each gradient is applied as it arrives, scaled by 1/W, so W of them move as far as one sync step."""

    drops_late = False  #: every gradient is taken, however stale (only a lost worker's can be dropped)
    backup = 0  #: no backup workers: no round waits for fewer than every live worker

    def __init__(self, workers: int):
        self.workers = workers
        self.per_step = workers  #: updates per global step

    def admits(self, used: int, current: int) -> bool:
        """A gradient computed on version ``used`` while the parameters are at ``current``: always taken."""
        return True

    def quorum(self, live: int) -> int:
        return 1

    def weight(self, count: int) -> float:
        return 1.0 / self.workers

    def describe(self) -> str:
        return "each gradient applied as it arrives, scaled by 1/W"


class Rounds:
    """Synchronous rounds with ``backup`` backup workers: the first W − B fresh gradients make an update."""

    drops_late = True  #: a gradient computed on older parameters is dropped: reports count drops, even none

    def __init__(self, workers: int, backup: int):
        if not 0 <= backup < workers:
            raise ValueError(f"backup workers {backup} must be in 0..{workers - 1}")
        self.workers, self.backup = workers, backup
        self.per_step = 1

    def admits(self, used: int, current: int) -> bool:
        """Only a gradient computed on the current parameters counts; a late one is dropped."""
        return used == current

    def quorum(self, live: int) -> int:
        return min(self.workers - self.backup, live)

    def weight(self, count: int) -> float:
        return 1.0 / count  # the mean of the gradients in the update

    def describe(self) -> str:
        if self.backup == 0:
            return "every live worker's gradient of the step averaged into one update"
        return (f"each update averages the first {self.workers - self.backup} of {self.workers} gradients; "
                "late ones dropped")


Rule = Asynchronous | Rounds
