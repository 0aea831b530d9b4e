"""Inside a worker: the run's learning rate over its steps, on the optimizer that applies the updates.

phalanx's own schedule (``schedules.py``) is a pure function of the step: the step alone puts it where it
was on a resume, under the settings in force now. The user's (``--lr-scheduler``) is stepped the same
way and saved in every checkpoint, which a resume loads.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from ..task import resolve
from ..task.schedules import Schedule


class LearningRate:
    """The scheduler one rank steps once per global step, the rate each step used, and what a checkpoint
    keeps of it."""

    def __init__(self, runtime: Any, task: Any, cfg: Any, step: int, resumed: Optional[dict[str, Any]]):
        self.task = task
        self.schedule = Schedule(cfg.lr_schedule, cfg.lr_decay_every, cfg.lr_decay_factor, cfg.staircase,
                                 cfg.warmup_steps, cfg.steps)
        # A parameter server's workers never step their own optimizer (the server does): torch
        # would warn on every step that the schedule advances before the optimizer.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        self.scheduler = self._scheduler(runtime, cfg, step, resumed)
        # What each step steps: nothing under a constant schedule of phalanx's own (its multiplier is 1 at every
        # step; the scheduler, built all the same, set the learning rate a resume starts from).
        own_constant = task.make_scheduler is None and self.schedule.constant
        self.stepped = None if own_constant else self.scheduler
        # The first param group, whose lr the metrics file logs: held, so that a step reads it in one lookup
        # (the optimizer's groups are replaced only by a load, done before this).
        self.group = runtime.optimizer.param_groups[0]
        self.used = self.group["lr"]  #: the learning rate the optimizer used in the step just taken

    def _scheduler(self, runtime: Any, cfg: Any, step: int, resumed: Optional[dict[str, Any]]) -> Optional[Any]:
        """The run's LR scheduler on the optimizer that applies the updates (None on a rank whose optimizer
        never steps: a parameter server's worker, whose server's scheduler is the run's).

        The user's (``--lr-scheduler``) continues from the checkpoint's state where it has one, and the
        optimizer's learning rates are put back to where that state left them (a chainable scheduler, e.g.
        StepLR, reads them). phalanx's own is a pure function of the step: the step alone puts it where it
        was, under the settings in force now (a checkpoint's scheduler state would bring back its old ones)."""
        if not runtime.steps_optimizer:
            return None
        optimizer, task = runtime.optimizer, self.task
        if task.make_scheduler is None and cfg.lr_scheduler:  # a checkpoint's, on --resume
            task.make_scheduler = resolve(cfg.lr_scheduler, "--lr-scheduler", "optimizer -> LR scheduler")
        if task.make_scheduler is None:
            return torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule, last_epoch=step - 1)
        scheduler = task.scheduler(optimizer, cfg.steps)
        saved = (resumed or {}).get("lr_scheduler")
        if saved is not None:
            scheduler.load_state_dict(saved)
            for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
        return scheduler

    def before_step(self) -> None:
        """Before a step: the rate it uses (read before the scheduler moves it on)."""
        self.used = self.group["lr"]

    def advance(self) -> None:
        """After a step's update: the rate of the next."""
        if self.stepped is not None:
            self.stepped.step()

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint at ``step`` keeps: phalanx's own schedule under ``scheduler``; the
        user's under ``lr_scheduler``, which a resume loads (phalanx's is recomputed from the step)."""
        if self.scheduler is None:
            return {}
        key = "lr_scheduler" if self.task.make_scheduler is not None else "scheduler"
        if self.stepped is None:  # a constant schedule, never stepped: its count as if it had been
            self.scheduler.last_epoch = step
        return {key: self.scheduler.state_dict()}
