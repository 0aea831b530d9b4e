"""Synchronous data parallelism: PyTorch DDP is the engine.

Communication: at start every rank compares a fingerprint of its weights with rank 0's
(``replicas.py``: DDP would otherwise just overwrite them with rank 0's and hide a model built
differently on each worker); during backward, DDP all-reduces gradient
buckets as they become ready, overlapping communication with the rest of the backward pass. Every
rank then applies the same averaged gradient, so the replicas stay identical: N workers with
batch B compute what one process computes with batch N·B. Gradient accumulation runs the inner
micro-batches under ``no_sync`` (no all-reduce), so K accumulated steps cost one all-reduce.
Buffers (BatchNorm's running statistics) are rank 0's, as DDP broadcasts them before every forward;
an evaluation gives every rank rank 0's first, so the model it measures is the one saved. When a
worker dies, the survivors hold the model of the last step they finished, and one of them saves it (no
collective: ``launcher/survivors.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ClassVar, Iterable, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .costs import SyncCost
from ...simulate import LOCKSTEP
from ...errors import PhalanxError
from ...options import option
from ...comm.reduce import COMPRESSIONS, REDUCTIONS, apply_reduction, parse_islands, validate_islands
from ...topology import order_by_islands, rank_islands
from ...task.metrics import Totals
from ..base import COUNT_CORRECT, Batch, Build, Report, Runtime, SurvivorState
from ..options import Options
from ..layout import Job, Layout, data_parallel
from ..registry import register
from ..replicas import broadcast_buffers, contiguous_buffers, verify_replicas


@dataclasses.dataclass(frozen=True)
class Sync(Options):
    """Synchronous data parallelism (DDP), and how its gradients are reduced."""

    name: ClassVar[str] = "sync"
    checkpoints_activations: ClassVar[bool] = True
    summary: ClassVar[str] = "gradients averaged every step, one update (= one large batch); PyTorch DDP"
    reference: ClassVar[bool] = True
    fp16_scaler: ClassVar[bool] = True
    survivors_save: ClassVar[bool] = True

    reduce: str = option("flat", "how gradients are reduced: one all-reduce, within islands then across, "
                                 "or hierarchical only where the topology gives it something to win",
                         choices=REDUCTIONS)
    compress: Optional[str] = option(None, "gradients travel in half precision", choices=("bf16", "fp16"))
    islands: Optional[tuple[tuple[int, ...], ...]] = option(
        None, "ranks grouped for --reduce, e.g. '0,1;2,3'", parse=parse_islands, show="from the GPU topology")
    bucket_mb: float = option(25.0, "DDP gradient bucket size in MiB")

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise PhalanxError(f"unknown --reduce {self.reduce!r}: choose one of {', '.join(REDUCTIONS)}")
        if self.compress == "none":
            self._set(compress=None)
        if self.compress not in COMPRESSIONS:
            raise PhalanxError(f"unknown --compress {self.compress!r}: choose bf16 or fp16 (or leave it out)")
        if not self.bucket_mb > 0:
            raise PhalanxError(f"--bucket-mb must be positive, got {self.bucket_mb}")
        if self.islands is not None:
            self._set(islands=tuple(tuple(int(r) for r in island) for island in self.islands))

    def layout(self, job: Job) -> Layout:
        base = data_parallel(job)
        if self.islands is not None:
            validate_islands(self.islands, base.world_size)
            return dataclasses.replace(base, islands=self.islands)
        on_gpus = job.devices[0].type == "cuda"
        if self.reduce == "hierarchical" and not on_gpus:
            raise PhalanxError("--reduce hierarchical on CPU workers needs the islands spelled out: "
                               "--islands '0,1;2,3' (on GPUs they come from the topology)")
        if self.reduce == "flat" or not on_gpus or job.gpu_islands is None or job.processes is not None:
            return base
        # On GPUs: order the workers so that every island's ranks are contiguous.
        islands = [list(i) for i in job.gpu_islands]
        ordered = order_by_islands([d.index for d in job.devices], islands)
        return dataclasses.replace(base, devices=tuple(torch.device("cuda", i) for i in ordered),
                                   islands=tuple(tuple(i) for i in rank_islands(ordered, islands)))

    def compiles_whole(self, world_size: int) -> bool:
        return world_size == 1  # (on more, DDP's buckets reduce while backward runs: a block at a time)

    def runtime(self, build: Build) -> Runtime:
        return SyncRuntime(build, self)


# Its cost model, for phalanx estimate (costs.py); its simulated rule, for compare --simulate (simulate/lockstep.py).
register(Sync, cost=SyncCost(), simulated=LOCKSTEP)


class ModelDDP(DDP):
    """DDP that still answers the model's own attributes (pytorch/examples' ``model.init_hidden(bsz)``, a
    ``model.config``), so a training step of the user's finds on the model it is handed what it wrote there, while
    calling it still runs DDP's forward (the gradients reduced). DDP's own attributes win; the rest is the
    wrapped module's, as Horovod's and Accelerate's wrappers keep the wrapped interface."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")  # (absent while DDP's constructor runs)
            if inner is None or name.startswith("__"):
                raise
            return getattr(inner, name)


class SyncRuntime(Runtime):
    one_batch = True  # (DDP averages every rank's gradients before each update)

    def __init__(self, build: Build, options: Sync):
        ctx = build.ctx
        if not ctx.distributed:
            super().__init__(build, description="sync (DDP)")
            return
        # Checked before DDP's own broadcast from rank 0 would silently paper over a difference.
        verify_replicas(build.model, ctx)
        contiguous_buffers(build.model)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        model = ModelDDP(build.model, device_ids=device_ids, bucket_cap_mb=options.bucket_mb)
        islands = [list(i) for i in build.layout.islands] if build.layout.islands else None
        applied = apply_reduction(model, options.reduce, options.compress, islands, ctx.world_size, ctx.rank,
                                  cpu=ctx.device.type == "cpu")
        self.reduction = applied.phrase  # what the report says
        super().__init__(build, model, description="sync (DDP)" if applied.plain else f"sync (DDP, {applied.phrase})")

    @property
    def module(self) -> nn.Module:
        return self.model.module if isinstance(self.model, DDP) else self.model

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.model.no_sync() if isinstance(self.model, DDP) else contextlib.nullcontext()

    def evaluate(self, batches: Iterable[Batch], totals: Totals = COUNT_CORRECT) -> tuple[float, ...]:
        # Each rank's last forward moved its own buffers; DDP hands every rank rank 0's before the next
        # forward anyway, so taking them now changes no step, and every part of the test set is evaluated
        # by the model rank 0 saves.
        if isinstance(self.model, DDP):
            broadcast_buffers(list(self.module.buffers()))
        return super().evaluate(batches, totals)

    def survivor_state(self, step: int, survivors) -> SurvivorState:
        # Every rank holds the same model after every step, and a step's update follows its last collective
        # (DDP's all-reduce ends inside backward): this rank holds ``step``, the same as any other survivor.
        return SurvivorState(step, Runtime.own_state(self))  # (the base's: this rank's own, no collective)

    def report(self, final: bool = False) -> Report:
        return Report({"reduction": getattr(self, "reduction", "none (one process)")})
