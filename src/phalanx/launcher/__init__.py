"""Start workers on one machine, or join a job that ``torchrun`` or Slurm's ``srun`` started.

- :mod:`.context`: a worker's place in the job (rank, device, cores) and how it joins the group;
- :mod:`.local`: starting the workers of a job on one machine (:func:`launch`), and :mod:`.monitor`: watching them
  until they end;
- :mod:`.loopback`: a one-machine job's store and groups listen on loopback only;
- :mod:`.joined`: a worker of a job torchrun or srun started, and how it leaves;
- :mod:`.stopping`: how the launcher takes a stop request (SIGTERM, SIGINT), wherever it arrived;
- the process's life: :mod:`.env` (which launcher started this process: pure, free of torch), :mod:`.startup`
  (the marks of a run's start-up), :mod:`.forkserver`, :mod:`.forkserver_signals`, :mod:`.forkserver_gc` and
  :mod:`.forkserver_models` (the server every worker forks from), :mod:`.watch` and :mod:`.hang_report` (a hung
  or dead peer), :mod:`.survivors` (the ranks left after a peer died).
"""

import importlib

#: public name -> the submodule that defines it. Imported when first used (PEP 562): the CLI starts the worker
#: server (forkserver.py) and reads the launcher's environment (env.py) before torch is imported, and the
#: other submodules import torch.
_WHERE = {
    **{name: "context" for name in ("DEFAULT_TIMEOUT_S", "WorkerContext", "available_cores", "in_torchrun",
                                    "launcher_rank", "launcher_world_size", "local_world_size",
                                    "threads_per_worker", "world_size")},
    "joined_a_group": "joined", "leave": "joined",
    "launch": "local",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
