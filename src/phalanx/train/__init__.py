"""The training loop and what it needs: config, schedules, checkpoints, reporting."""

from .config import TrainConfig
from ..task.schedules import Schedule, scaled_lr
from .result import TrainResult
from .trainer import Trainer

__all__ = ["Schedule", "TrainConfig", "TrainResult", "Trainer", "scaled_lr"]
