"""Start workers on one machine, or join a job that ``torchrun`` or Slurm's ``srun`` started.

- :mod:`.context`: a worker's place in the job (rank, device, cores) and how it joins the group;
- :mod:`.local`: starting and watching the workers of a job on one machine (:func:`launch`);
- :mod:`.joined`: a worker of a job torchrun or srun started, and how it leaves;
- :mod:`.stopping`: how the launcher takes a stop request (SIGTERM, SIGINT), wherever it arrived;
(:mod:`phalanx.launch_env` reads which launcher started this process: pure, and free of torch.)
"""

from .context import (DEFAULT_TIMEOUT_S, WorkerContext, available_cores, in_torchrun, launcher_rank,
                      launcher_world_size, local_world_size, threads_per_worker, world_size)
from .joined import joined_a_group, leave
from .local import launch

__all__ = ["DEFAULT_TIMEOUT_S", "WorkerContext", "available_cores", "in_torchrun", "joined_a_group", "launch",
           "launcher_rank", "launcher_world_size", "leave", "local_world_size", "threads_per_worker", "world_size"]
