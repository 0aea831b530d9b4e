"""phalanx: train one PyTorch model on many devices."""

from .devices import resolve_devices
from .errors import PhalanxError, TrainingDiverged, WorkerFailed
from .launch import WorkerContext, launch
from .parallel import ParallelModule, make_parallel
from .strategies import Pipeline, Strategy, Sync
from .topology import Topology, detect_topology
from .train import Schedule, TrainConfig, Trainer

__all__ = [
    "ParallelModule", "PhalanxError", "Pipeline", "Schedule", "Strategy", "Sync", "Topology", "TrainConfig",
    "Trainer", "TrainingDiverged", "WorkerContext", "WorkerFailed", "detect_topology", "launch", "make_parallel",
    "resolve_devices",
]
__version__ = "0.1.0"
