"""What the parent hands every worker: the run, checked and laid out (``trainer.py`` makes it, ``loop.py`` runs
it; both import it from here, so neither imports the other's side)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..data import DataBundle
from ..strategies import Layout
from ..task import Task
from .config import TrainConfig


@dataclasses.dataclass
class Plan:
    """Everything a worker needs, checked in the parent and sent (pickled) to every worker."""

    config: TrainConfig  #: resolved: every unset field filled from the recipe
    layout: Layout
    task: Task  #: the user's problem: model factory, loss, optimizer factory (its data travels as ``data``)
    data: Optional[DataBundle]  #: the data, where small enough to send (else each worker loads it)
    resume_path: Optional[str]
    recipe: str  #: the recipe line of the header
    workers: int  #: the workers the user asked for (a parameter server adds one process)
    run_id: str = ""  #: the run this job is (written in every checkpoint and the metrics file)
    remove: tuple = ()  #: --overwrite: another run's files, removed once the directory is locked
    #: start-up marks: when the command began, and seconds from then until the plan was ready
    began: float = 0.0
    planned: float = 0.0
