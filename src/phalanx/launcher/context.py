"""A worker's place in the job, and how a worker joins it (whoever started the process).

How many workers, how many on this machine, and how many cores each: phalanx's own numbers when it
starts the workers, the launcher's under torchrun or srun (:mod:`phalanx.launcher.env` reads which it was).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..devices import backend_for
from .watch import Progress, enable_flight_recorder
from .env import joined

#: How long a collective may wait for a peer before gloo/NCCL gives up. A dead peer is normally
#: noticed much sooner, by the parent seeing the process exit.
DEFAULT_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    """Where this worker stands in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: world size 1, no process group
    #: the job's rendezvous store (None: world size 1), for agreements outside the process group
    store: Optional[dist.Store] = dataclasses.field(default=None, compare=False, repr=False)
    #: this rank's published progress and the stop request it received
    progress: Progress = dataclasses.field(default_factory=lambda: Progress(0), compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def in_torchrun() -> bool:
    """True inside a job another launcher started: torchrun (RANK, WORLD_SIZE) or Slurm's srun."""
    return joined() is not None


def launcher_world_size() -> Optional[int]:
    """The world size the launcher fixed (torchrun's WORLD_SIZE, Slurm's task count); None: phalanx spawns."""
    job = joined()
    return job.world_size if job is not None else None


def launcher_rank() -> int:
    """This process's rank in a job another launcher started (0 when phalanx starts the workers itself)."""
    job = joined()
    return job.rank if job is not None else 0


def world_size(devices: Sequence[torch.device]) -> int:
    """Workers in the job: the launcher's world size, else one per device slot."""
    return launcher_world_size() or len(devices)


def local_world_size(default: int) -> int:
    """Workers on this machine (they share its cores)."""
    job = joined()
    return (job.local_world_size or default) if job is not None else default


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_worker(workers: int) -> int:
    """Each CPU worker gets its share of the cores, so workers do not fight over them."""
    return max(1, available_cores() // max(1, workers))


def init_worker(
    rank: int,
    world_size: int,
    local_rank: int,
    device: torch.device,
    threads: int | None,
    store: dist.Store | None,
    timeout_s: float,
    init_method: str = "env://",
    progress: Optional[Progress] = None,
) -> WorkerContext:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if threads:
        torch.set_num_threads(threads)
    progress = progress or Progress(rank)
    if world_size == 1:
        return WorkerContext(rank, 1, local_rank, device, None, progress=progress)
    backend = backend_for([device])
    bars_without_semaphores()
    enable_flight_recorder()  # so that a hang report can say which collective each rank waits in
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    return WorkerContext(rank, world_size, local_rank, device, backend, store=store, progress=progress)


def bars_without_semaphores() -> None:
    """A thread lock as tqdm's lock in this process (a worker; the process drawing a run's progress bar). tqdm's
    default lock holds a multiprocessing lock too, a named semaphore that a worker ending with ``os._exit`` never
    unlinks: inductor shows a bar while it compiles, and every ``--compile`` run ended with "resource_tracker: There
    appear to be 2 leaked semaphore objects". Neither has a process of its own drawing bars to share the lock with."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
