"""The training loop and what it needs: config, schedules, checkpoints, reporting."""

from .config import TrainConfig
from ..task.schedules import Schedule, scaled_lr
from .trainer import Trainer

__all__ = ["Schedule", "TrainConfig", "Trainer", "scaled_lr"]
