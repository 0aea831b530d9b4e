"""phalanx: train one PyTorch model on many devices."""

from .devices import resolve_devices
from .errors import PhalanxError, WorkerFailed

__all__ = ["PhalanxError", "WorkerFailed", "resolve_devices"]
__version__ = "0.1.0"
