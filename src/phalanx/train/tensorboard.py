"""``--tensorboard DIR``: the metrics file's numbers as TensorBoard scalars, written beside it.

The process that writes the metrics file (rank 0, which also holds every evaluation's values:
they are reduced over the ranks before it records them) hands each record to :class:`Board` as
well, so the curves in TensorBoard are the metrics file's values, at the same steps and times:

- every log step: ``train/loss``, ``train/lr``, ``train/examples_per_sec``, ``train/grad_norm`` (under
  ``--clip-grad-norm``: the norm before clipping), and where the strategy
  reports them ``staleness/mean|p95|max`` and ``gradients/applied|dropped`` (totals so far);
- every evaluation: ``test/METRIC`` for each metric (``validation/METRIC`` for a held-out part).

torch's ``SummaryWriter`` writes the event files; the ``tensorboard`` package it needs is an
optional extra, checked in the parent before anything starts (:func:`check`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Optional

from ..errors import PhalanxError

#: step-event field -> its TensorBoard tag
STEP_TAGS = {"loss": "train/loss", "lr": "train/lr", "examples_per_sec": "train/examples_per_sec",
             "grad_norm": "train/grad_norm",
             "staleness_mean": "staleness/mean", "staleness_p95": "staleness/p95", "staleness_max": "staleness/max",
             "gradients_applied_total": "gradients/applied", "gradients_dropped_total": "gradients/dropped"}


def check(directory: Optional[str], flag: str = "--tensorboard") -> None:
    """The package is installed and the folder can be made, or one line naming the fix (nothing written)."""
    if directory is None:
        return
    if importlib.util.find_spec("tensorboard") is None:
        raise PhalanxError(f"{flag} {directory} needs the tensorboard package: pip install 'phalanx[tensorboard]' "
                           f"(or drop {flag})")
    probe = Path(directory)
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise PhalanxError(f"{flag} {directory} cannot be written ({probe} is not a writable folder); choose "
                           "another folder")


class Board:
    """One run's SummaryWriter, fed the metrics file's records."""

    def __init__(self, directory: str, resumed_at: Optional[int] = None):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run rewrites the steps after its checkpoint: TensorBoard drops what an earlier
        # attempt wrote from there on (purge_step), as the metrics file keeps only the steps up to it.
        self.writer = SummaryWriter(directory, purge_step=None if resumed_at is None else resumed_at + 1,
                                    flush_secs=10)

    def write(self, event: str, fields: dict[str, Any]) -> None:
        step, when = fields.get("step"), fields.get("time")
        if not isinstance(step, int):
            return
        if event == "step":
            scalars = {tag: fields.get(name) for name, tag in STEP_TAGS.items()}
        elif event == "eval":
            part = fields.get("held_out") or "test"
            scalars = {f"{part}/{name}": value for name, value in (fields.get("metrics") or {}).items()}
        else:
            return
        for tag, value in scalars.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, value, step, walltime=when)

    def close(self) -> None:
        self.writer.close()
