"""The training run's configuration: one validated dataclass; the CLI only maps flags onto it."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from ..errors import PhalanxError
from ..strategies import Strategy, strategy_from_name
from .schedules import SCHEDULES

OPTIMIZERS = ("sgd", "adam")
PROGRESS = ("auto", "bar", "lines", "none")


@dataclasses.dataclass
class TrainConfig:
    # --- how the replicas cooperate ---
    strategy: Union[str, Strategy] = "sync"  #: a Strategy, or its CLI name with default options
    devices: Union[str, int, list] = "auto"  #: device spec (see phalanx.devices)
    strict_devices: bool = False  #: fail instead of falling back to the CPU
    workers: Optional[int] = None  #: worker processes (default: one per GPU; on CPU, 2)
    threads: Optional[int] = None  #: torch threads per CPU worker (default: its share of the cores)
    # --- what is trained ---
    model: str = "cnn"  #: built-in model name (ignored when a model object is given to Trainer)
    data: str = "digits"  #: digits | cifar10 | synthetic (ignored when data is given to Trainer)
    data_dir: Optional[str] = None  #: where the CIFAR-10 binary files are
    synthetic_shape: tuple = (3, 24, 24)  #: input shape of synthetic examples
    synthetic_size: int = 4096  #: number of synthetic examples (train + test)
    # --- optimisation ---
    steps: int = 300  #: global steps (one optimizer update each)
    batch_size: int = 32  #: examples per worker per step (global batch = this x workers)
    accumulate: int = 1  #: micro-batches per step; all-reduce only after the last
    optimizer: str = "sgd"  #: sgd (with momentum) | adam
    lr: float = 0.05  #: peak learning rate (before the linear scaling rule, if any)
    momentum: float = 0.9  #: SGD momentum
    weight_decay: float = 0.0  #: L2 penalty
    lr_schedule: str = "constant"  #: constant | exponential | cosine
    lr_decay_every: int = 100  #: exponential: steps per decay
    lr_decay_factor: float = 0.5  #: exponential: multiplier per decay_every steps
    staircase: bool = False  #: exponential: decay in whole steps
    warmup_steps: int = 0  #: linear warmup length
    lr_base_batch: Optional[int] = None  #: linear scaling rule: lr x global batch / this
    seed: int = 0  #: model initialisation and data order
    straggler: Optional[Union[str, tuple]] = None  #: "RANK:FACTOR": that rank takes FACTOR x as long per step
    # --- observation and safety ---
    log_every: int = 20  #: progress line every N steps
    eval_every: int = 0  #: evaluate on the test set every N steps (0: only at the end)
    metrics: Optional[str] = None  #: JSON-lines file (default: <checkpoint_dir>/metrics.jsonl)
    checkpoint_dir: str = "checkpoints"  #: where step-*.pt files go
    checkpoint_every: int = 100  #: save every N steps (0: only at the end)
    keep_checkpoints: int = 3  #: keep the newest K checkpoints
    resume: Optional[str] = None  #: checkpoint file or directory to continue from
    progress: str = "auto"  #: auto (bar on a terminal) | bar | lines | none
    prefetch: int = 2  #: batches prepared ahead of the towers
    master_addr: str = "127.0.0.1"  #: address the workers rendezvous on (one machine)
    timeout_s: float = 300.0  #: how long a collective may wait for a peer

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "accumulate", "log_every", "keep_checkpoints", "prefetch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PhalanxError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name in ("eval_every", "checkpoint_every", "warmup_steps"):
            if getattr(self, name) < 0:
                raise PhalanxError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}")
        for name in ("workers", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise PhalanxError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.batch_size % self.accumulate:
            raise PhalanxError(
                f"--batch-size {self.batch_size} does not split into --accumulate {self.accumulate} equal "
                f"micro-batches ({self.batch_size} / {self.accumulate} = {self.batch_size / self.accumulate:g})"
            )
        if self.optimizer not in OPTIMIZERS:
            raise PhalanxError(f"unknown optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise PhalanxError(f"--lr must be positive, got {self.lr}")
        if self.lr_schedule not in SCHEDULES:
            raise PhalanxError(f"unknown --lr-schedule {self.lr_schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.progress not in PROGRESS:
            raise PhalanxError(f"unknown --progress {self.progress!r}: choose one of {', '.join(PROGRESS)}")
        if isinstance(self.straggler, str):
            self.straggler = parse_straggler(self.straggler)
        if isinstance(self.strategy, str):
            self.strategy = strategy_from_name(self.strategy)
        if self.metrics is None:
            self.metrics = f"{self.checkpoint_dir}/metrics.jsonl"


def parse_straggler(text: str) -> tuple[int, float]:
    try:
        rank, factor = text.split(":")
        parsed = int(rank), float(factor)
    except ValueError:
        raise PhalanxError(f"--straggler {text!r} is not RANK:FACTOR, e.g. 1:2 (rank 1 twice as slow)") from None
    if parsed[0] < 0 or parsed[1] < 1:
        raise PhalanxError(f"--straggler {text!r}: the rank must be 0 or more and the factor at least 1")
    return parsed
