"""Hogwild!: workers on one machine update shared parameters without locks.

Communication: none. Rank 0 writes the initial parameters into one flat float32 buffer in shared
memory (a file under /dev/shm that every worker maps, then unlinked at once, so the memory goes
with the last worker however the job ends); every worker's parameters are views into
that buffer, so each optimizer step writes straight into what the others read, with no lock
(Niu et al., 2011). Optimizer state (momentum) is private to each worker. A counter slot per
worker in the same buffer counts updates, so the staleness of each update (the updates others
applied between this worker's read and its write) is recorded. float32 buffers (BatchNorm's running
statistics) live in the same shared memory, as ``model.share_memory()`` would put them for torch's own
Hogwild example: every worker's forward moves the one set of statistics; other buffers (step counts)
are rank 0's at the end. So after the last step every worker holds the model rank 0 saves.

One machine and the CPU only: GPU memory is not shared between processes this way, and CUDA's
IPC handles would not make unlocked concurrent writes safe, so CUDA is refused.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from ...errors import PhalanxError
from ...launcher import WorkerContext
from ..base import Batch, Build, Report, Runtime
from ..options import Options
from ..layout import Job, Layout, StopRule, data_parallel
from ..registry import register
from ...comm.staleness import StalenessStats
from ..replicas import average_buffers, verify_replicas


@dataclasses.dataclass(frozen=True)
class Hogwild(Options):
    name: ClassVar[str] = "hogwild"
    one_piece_backward: ClassVar[bool] = True
    summary: ClassVar[str] = "lock-free updates to parameters in shared memory (one machine, CPU)"
    cpu_only: ClassVar[bool] = True

    def layout(self, job: Job) -> Layout:
        if self.cpu_only and any(d.type != "cpu" for d in job.devices):
            raise PhalanxError("hogwild shares parameters through CPU shared memory and refuses CUDA: use "
                               "--devices cpu, or --strategy ssp/ps for asynchronous training on GPUs")
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if job.processes is not None and local not in (None, str(job.processes)):
            raise PhalanxError("hogwild runs on one machine only (its parameters live in shared memory); "
                               "use --strategy ps or ssp across machines")
        # No collective per step: each worker stops at its own next step when asked.
        return dataclasses.replace(data_parallel(job), stop_rule=StopRule.EACH)

    def describe(self) -> str:
        return "hogwild (lock-free updates to shared memory)"

    def runtime(self, build: Build) -> Runtime:
        return HogwildRuntime(build, self)


# No cost model yet (estimate leaves it out) and no simulated rule (its unlocked writes have no schedule to play).
register(Hogwild)


def reclaim_leftovers(directory: str) -> list[str]:
    """Remove shared-memory files of Hogwild runs whose creator is gone (killed between creating the
    file and every worker mapping it, the only moment a file can be left behind)."""
    removed = []
    for name in os.listdir(directory):
        m = re.match(r"phalanx-hogwild-(\d+)-", name)
        if m and not _alive(int(m.group(1))):
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HogwildRuntime(Runtime):
    def __init__(self, build: Build, options: Hogwild):
        ctx, model = build.ctx, build.model
        self.path: Optional[str] = None
        self.staleness = StalenessStats(bound=None)
        # What every worker writes into and reads: the parameters, and the float32 buffers beside them.
        params = list(model.parameters()) + [b for b in model.buffers() if b.dtype == torch.float32]
        self.unshared = [b for b in model.buffers() if b.dtype != torch.float32]
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
                p.data = view  # from now on the parameter (or buffer) *is* the shared memory
                offset += p.numel()
        self.counters = shared[size:]
        if ctx.distributed:
            dist.barrier()  # nobody reads before rank 0 has written the initial values
            if self.path is not None:  # every rank has mapped it: the name can go, the memory stays mapped
                os.unlink(self.path)    # (and goes with the last process, however it ends: nothing leaks)
                self.path = None
        super().__init__(build, description=options.describe())

    def _map_shared(self, ctx: WorkerContext, count: int) -> torch.Tensor:
        name: list[Optional[str]] = [None]
        if ctx.rank == 0:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            reclaim_leftovers(shm)
            fd, path = tempfile.mkstemp(prefix=f"phalanx-hogwild-{os.getpid()}-", dir=shm)
            os.ftruncate(fd, count * 4)
            os.close(fd)
            name = [path]
            self.path = path
        dist.broadcast_object_list(name, src=0)
        assert name[0] is not None, "rank 0 named the file"
        return torch.from_file(name[0], shared=True, size=count, dtype=torch.float32)

    def train_step(self, batch: Batch, y: Optional[torch.Tensor] = None, parts: Optional[int] = None) -> torch.Tensor:
        rank = self.ctx.rank
        seen = float(self.counters.sum()) - float(self.counters[rank])
        loss = super().train_step(batch, y, parts)
        self.counters[rank] += 1
        others = float(self.counters.sum()) - float(self.counters[rank])
        self.staleness.record(int(others - seen))
        return loss

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every rank writes the checkpoint's (same) parameters into the shared buffer, then waits for the
        others: a late rank's copy would otherwise undo the updates an early one already made."""
        super().load_state_dict(state)
        if self.ctx.distributed:
            dist.barrier()

    def finish(self, stopping: bool = False) -> bool:
        """Every worker's last write is in the shared memory once all have passed the barrier: rank 0's
        checkpoint of its last step may predate the others', so the final one is written again."""
        super().finish()
        if not self.ctx.distributed:
            return False
        average_buffers(self.unshared)  # (integer step counts: rank 0's, which it saves)
        return True

    def global_losses(self, losses: torch.Tensor) -> torch.Tensor:
        return losses  # no collective: workers never wait for each other

    def report(self, final: bool = False) -> Report:
        return Report(self.staleness.to_dict(), [self.staleness.line()])

    def close(self) -> None:
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)
