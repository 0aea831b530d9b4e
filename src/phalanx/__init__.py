"""phalanx: train one PyTorch model on many devices."""

__version__ = "0.2.0"

from .devices import resolve_devices  # noqa: E402  (the version first: the CLI reads it)
from .errors import PhalanxError, TrainingDiverged, WorkerFailed  # noqa: E402
from .launch import WorkerContext, launch  # noqa: E402
from .parallel import ParallelModule, make_parallel  # noqa: E402
from .strategies import (FSDP, SSP, STRATEGIES, Backup, DiLoCo, Hogwild, LocalSGD, Options, ParameterServer,  # noqa: E402
                         Pipeline, Runtime, Sync)
from .topology import Topology, detect_topology  # noqa: E402
from .train import Schedule, TrainConfig, Trainer  # noqa: E402
from .data import ArrayDataset  # noqa: E402

__all__ = [
    "ArrayDataset", "Backup", "DiLoCo", "FSDP", "Hogwild", "LocalSGD", "Options", "ParallelModule", "ParameterServer",
    "PhalanxError", "Pipeline", "Runtime", "SSP", "STRATEGIES", "Schedule", "Sync", "Topology", "TrainConfig",
    "Trainer", "TrainingDiverged", "WorkerContext", "WorkerFailed", "detect_topology", "launch", "make_parallel",
    "resolve_devices",
]
