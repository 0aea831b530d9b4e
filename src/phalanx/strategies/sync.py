"""Synchronous data parallelism: PyTorch DDP is the engine.

Communication: at start every rank compares a parameter checksum with rank 0's (phalanx's loud
check that the replicas really are identical: DDP would otherwise just overwrite them with rank
0's and hide a model built differently on each worker); during backward, DDP all-reduces gradient buckets as they become ready,
overlapping communication with the rest of the backward pass. Every rank then applies the same
averaged gradient, so the replicas stay identical: N workers with batch B compute what one
process computes with batch N·B. Gradient accumulation runs the inner micro-batches under
``no_sync`` (no all-reduce), so K accumulated steps cost one all-reduce.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ClassVar, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import PhalanxError
from ..launch import WorkerContext
from ..reduce import COMPRESSIONS, REDUCTIONS, apply_reduction, validate_islands
from .base import OptimizerFactory, Strategy


def parameter_checksum(module: nn.Module) -> torch.Tensor:
    """A float64 fingerprint of every parameter and buffer: (sum, sum of squares, weighted sum)."""
    parts = [t.detach().double().flatten() for t in list(module.parameters()) + list(module.buffers())
             if t.is_floating_point()]
    if not parts:
        return torch.zeros(3, dtype=torch.float64)
    flat = torch.cat([p.cpu() for p in parts])
    ramp = torch.linspace(1.0, 2.0, len(flat), dtype=torch.float64)
    return torch.stack([flat.sum(), (flat * flat).sum(), (flat * ramp).sum()])


def verify_replicas(module: nn.Module, ctx: WorkerContext) -> None:
    """Fail loudly unless every rank holds the same parameters (compared through rank 0's)."""
    device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")  # NCCL moves CUDA tensors only
    mine = parameter_checksum(module).to(device)
    reference = mine.clone()
    dist.broadcast(reference, src=0)
    same = torch.tensor([1 if torch.allclose(mine, reference, rtol=1e-12, atol=0) else 0], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if not same.item():
        raise PhalanxError(
            f"replicas differ at start (rank {ctx.rank} checksum {mine.tolist()} vs rank 0 "
            f"{reference.tolist()}): build the model identically on every worker (same seed, same code)"
        )


@dataclasses.dataclass
class Sync(Strategy):
    """Synchronous data parallelism (DDP). Options for how gradients are reduced."""

    name: ClassVar[str] = "sync"
    #: "flat" (one all-reduce), "hierarchical" (within islands, then across), or "auto"
    reduce: str = "flat"
    #: None, "bf16" or "fp16": gradients travel in half precision
    compress: Optional[str] = None
    #: islands of ranks for hierarchical reduction (None: from the detected topology)
    islands: Optional[list[list[int]]] = None
    #: DDP bucket size in MiB (torch's default is 25)
    bucket_mb: float = 25.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reduce not in REDUCTIONS:
            raise PhalanxError(f"unknown --reduce {self.reduce!r}: choose one of {', '.join(REDUCTIONS)}")
        if self.compress == "none":
            self.compress = None
        if self.compress not in COMPRESSIONS:
            raise PhalanxError(f"unknown --compress {self.compress!r}: choose bf16 or fp16 (or leave it out)")
        if self.bucket_mb <= 0:
            raise PhalanxError(f"--bucket-mb must be positive, got {self.bucket_mb}")
        self.reduction = "flat all-reduce"

    def check_world(self, world_size: int, devices: list[torch.device]) -> None:
        if self.islands is not None:
            validate_islands(self.islands, world_size)
        elif self.reduce == "hierarchical" and devices[0].type != "cuda":
            raise PhalanxError("--reduce hierarchical on CPU workers needs the islands spelled out: "
                               "--islands '0,1;2,3' (on GPUs they come from the topology)")

    def plan_devices(self, devices: list[torch.device]) -> list[torch.device]:
        """On GPUs, order workers so islands stay contiguous and take the islands from the topology."""
        if self.reduce == "flat" or self.islands is not None or devices[0].type != "cuda" or len(devices) < 2:
            return devices
        from ..topology import detect_topology, order_by_islands, rank_islands

        gpu_islands = detect_topology(peer=True).islands()
        ordered = order_by_islands([d.index for d in devices], gpu_islands)
        self.islands = rank_islands(ordered, gpu_islands)
        return [torch.device("cuda", i) for i in ordered]

    def describe(self) -> str:
        return "sync (DDP)" if self.reduction == "flat all-reduce" else f"sync (DDP, {self.reduction})"

    def setup(self, ctx: WorkerContext, model: nn.Module, make_optimizer: OptimizerFactory):
        self.ctx = ctx
        if not ctx.distributed:
            return super().setup(ctx, model, make_optimizer)
        # Checked before DDP's own broadcast from rank 0 would silently paper over a difference.
        verify_replicas(model, ctx)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        self.model = DDP(model, device_ids=device_ids, bucket_cap_mb=self.bucket_mb)
        self.reduction = self._apply_reduction(ctx)
        self.optimizer = make_optimizer(self.model.parameters())
        return self.model, self.optimizer

    def _apply_reduction(self, ctx: WorkerContext) -> str:
        return apply_reduction(self.model, self.reduce, self.compress, self.islands, ctx.world_size, ctx.rank)

    @property
    def module(self) -> nn.Module:
        return self.model.module if isinstance(self.model, DDP) else self.model

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.model.no_sync() if isinstance(self.model, DDP) else contextlib.nullcontext()

    def stats(self, final: bool = False) -> dict:
        return {"reduction": self.reduction}
