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
        if self.reduce not in ("flat", "hierarchical", "auto"):
            raise PhalanxError(f"unknown --reduce {self.reduce!r}: choose flat, hierarchical or auto")
        if self.compress not in (None, "none", "bf16", "fp16"):
            raise PhalanxError(f"unknown --compress {self.compress!r}: choose bf16 or fp16 (or leave it out)")
        if self.compress == "none":
            self.compress = None
        if self.bucket_mb <= 0:
            raise PhalanxError(f"--bucket-mb must be positive, got {self.bucket_mb}")
        self.reduction = "flat"

    def describe(self) -> str:
        return "sync (DDP)"

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
        if self.reduce == "flat" and self.compress is None:
            return "flat all-reduce"
        from ..reduce import apply_reduction  # topology-aware hooks live with the topology code

        return apply_reduction(self.model, self.reduce, self.compress, self.islands, ctx.world_size, ctx.rank)

    @property
    def module(self) -> nn.Module:
        return self.model.module if isinstance(self.model, DDP) else self.model

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.model.no_sync() if isinstance(self.model, DDP) else contextlib.nullcontext()

    def stats(self) -> dict:
        return {"reduction": self.reduction}
