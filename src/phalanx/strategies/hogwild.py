"""Hogwild!: workers on one machine update shared parameters without locks.

Communication: none. Rank 0 writes the initial parameters into one flat float32 buffer in shared
memory (a file under /dev/shm that every worker maps); every worker's parameters are views into
that buffer, so each optimizer step writes straight into what the others read, with no lock
(Niu et al., 2011). Optimizer state (momentum) is private to each worker. A counter slot per
worker in the same buffer counts updates, so the staleness of each update (the updates others
applied between this worker's read and its write) is recorded.

One machine and the CPU only: GPU memory is not shared between processes this way, and CUDA's
IPC handles would not make unlocked concurrent writes safe, so CUDA is refused.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import ClassVar

import torch
import torch.distributed as dist

from ..errors import PhalanxError
from .base import Strategy
from .staleness import StalenessStats
from .sync import verify_replicas


@dataclasses.dataclass
class Hogwild(Strategy):
    name: ClassVar[str] = "hogwild"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.staleness = StalenessStats(bound=None)
        self.path = None

    def check_world(self, world_size, devices) -> None:
        if any(d.type != "cpu" for d in devices):
            raise PhalanxError("hogwild shares parameters through CPU shared memory and refuses CUDA: use "
                               "--devices cpu, or --strategy ssp/ps for asynchronous training on GPUs")
        if os.environ.get("WORLD_SIZE") and os.environ.get("LOCAL_WORLD_SIZE") not in (None, os.environ["WORLD_SIZE"]):
            raise PhalanxError("hogwild runs on one machine only (its parameters live in shared memory); "
                               "use --strategy ps or ssp across machines")

    def describe(self) -> str:
        return "hogwild (lock-free updates to shared memory)"

    def setup(self, ctx, model, make_optimizer):
        if ctx.device.type != "cpu":
            raise PhalanxError("hogwild refuses CUDA: use --devices cpu")
        params = list(model.parameters())
        size = sum(p.numel() for p in params)
        if ctx.distributed:
            verify_replicas(model, ctx)
            shared = self._map_shared(ctx, size + ctx.world_size)
        else:
            shared = torch.zeros(size + 1)
        offset = 0
        with torch.no_grad():
            for p in params:
                view = shared[offset:offset + p.numel()].view_as(p)
                if ctx.rank == 0:
                    view.copy_(p)
                p.data = view  # from now on the parameter *is* the shared memory
                offset += p.numel()
        self.counters = shared[size:]
        if ctx.distributed:
            dist.barrier()  # nobody reads before rank 0 has written the initial values
        return super().setup(ctx, model, make_optimizer)

    def _map_shared(self, ctx, count: int) -> torch.Tensor:
        name = [None]
        if ctx.rank == 0:
            fd, path = tempfile.mkstemp(prefix="phalanx-hogwild-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            os.ftruncate(fd, count * 4)
            os.close(fd)
            name = [path]
            self.path = path
        dist.broadcast_object_list(name, src=0)
        return torch.from_file(name[0], shared=True, size=count, dtype=torch.float32)

    def train_step(self, x, y, loss_fn, accumulate=1):
        seen = float(self.counters.sum()) - float(self.counters[self.ctx.rank])
        loss = super().train_step(x, y, loss_fn, accumulate)
        self.counters[self.ctx.rank] += 1
        others = float(self.counters.sum()) - float(self.counters[self.ctx.rank])
        self.staleness.record(int(others - seen))
        return loss

    def global_loss(self, loss):
        return loss  # no per-step collective: workers never wait for each other

    def stats(self, final=False):
        return self.staleness.to_dict()

    def summary_lines(self) -> list[str]:
        return [self.staleness.line()]

    def close(self) -> None:
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)
