"""phalanx: train one PyTorch model on many devices.

The names below are imported when first used (PEP 562), so that ``phalanx --version``, a flag
refused at parse time, and the start of a job's worker server do not wait for torch's import.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

#: public name -> the module that defines it
_WHERE = {
    "resolve_devices": "devices",
    "PhalanxError": "errors", "TrainingDiverged": "errors", "WorkerFailed": "errors",
    "WorkerContext": "launcher", "launch": "launcher",
    "ParallelModule": "parallel", "make_parallel": "parallel",
    **{name: "strategies" for name in ("FSDP", "SSP", "STRATEGIES", "Backup", "DiLoCo", "Hogwild", "LocalSGD",
                                       "Options", "ParameterServer", "Pipeline", "Runtime", "Sync")},
    "Topology": "topology", "detect_topology": "topology",
    "Schedule": "train", "TrainConfig": "train", "TrainResult": "train", "Trainer": "train",
    "ArrayDataset": "data",
    "evaluate": "train.evaluate",
}

#: subpackages that are also callable: ``phalanx.compare(model=...)``, ``phalanx.estimate(model=...)``
_CALLABLE = ("compare", "estimate")

__all__ = sorted([*_WHERE, *_CALLABLE])

if TYPE_CHECKING:  # the same names for type checkers and editors ("X as X": re-exported); at run time __getattr__
    # imports each when first used. compare and estimate are the functions their callable packages run, so a type
    # checker checks phalanx.compare(...)'s keywords and knows its result; `from phalanx.compare import X` still
    # reads the package.
    from .compare.api import compare as compare
    from .data import ArrayDataset as ArrayDataset
    from .devices import resolve_devices as resolve_devices
    from .errors import PhalanxError as PhalanxError, TrainingDiverged as TrainingDiverged, WorkerFailed as WorkerFailed
    from .estimate.api import estimate as estimate
    from .launcher import WorkerContext as WorkerContext, launch as launch
    from .parallel import ParallelModule as ParallelModule, make_parallel as make_parallel
    from .strategies import (FSDP as FSDP, SSP as SSP, STRATEGIES as STRATEGIES, Backup as Backup, DiLoCo as DiLoCo,
                             Hogwild as Hogwild, LocalSGD as LocalSGD, Options as Options,
                             ParameterServer as ParameterServer, Pipeline as Pipeline, Runtime as Runtime, Sync as Sync)
    from .topology import Topology as Topology, detect_topology as detect_topology
    from .train import Schedule as Schedule, TrainConfig as TrainConfig, TrainResult as TrainResult, Trainer as Trainer
    from .train.evaluate import evaluate as evaluate


def __getattr__(name: str) -> Any:
    if name not in _WHERE:  # a submodule by attribute (phalanx.devices.cuda_count()), as an eager package had it
        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
        return importlib.import_module(f".{name}", __name__)
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE) | set(_CALLABLE))
