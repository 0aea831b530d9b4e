"""The parent side of a training run: check everything, lay the job out, start the workers.

Read top to bottom: :meth:`Trainer.fit` builds a :class:`Plan` (every check of ``checks.py``,
the strategy's layout, the model's recipe; nothing written), creates the checkpoint directory,
then launches one process per rank of the layout, each running :func:`~phalanx.train.loop.run_worker`.

    python -c "import phalanx; phalanx.Trainer(phalanx.TrainConfig(steps=200)).fit()"
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..data import DataBundle
from ..devices import backend_for, resolve_devices
from ..errors import PhalanxError, WorkerFailed
from ..launch import in_torchrun, launch
from ..models import build_model
from ..strategies import Job, Layout
from . import checkpoint as ckpt
from . import checks
from .config import TrainConfig


@dataclasses.dataclass
class Plan:
    """Everything a worker needs, checked in the parent and sent (pickled) to every worker."""

    config: TrainConfig  #: resolved: every unset field filled from the recipe
    layout: Layout
    model: Optional[nn.Module]  #: the user's model object, or None for a built-in one
    data: Optional[DataBundle]  #: the data, where small enough to send (else each worker loads it)
    loss_fn: Callable
    resume_path: Optional[str]
    recipe: str  #: the recipe line of the header
    workers: int  #: the workers the user asked for (a parameter server adds one process)


class Trainer:
    """Train a model with the strategy the config names; ``fit()`` returns rank 0's summary.

    Bring your own model and data: ``Trainer(config, model=net, train_data=(x, y),
    test_data=(x_test, y_test))``. ``model`` is copied to every worker (it must be picklable);
    data is a pair of tensors or numpy arrays (inputs, integer labels), or an ``ArrayDataset``.
    A script that calls ``fit()`` must do so under ``if __name__ == "__main__":`` (workers are
    spawned and import the script again).
    """

    def __init__(self, config: Optional[TrainConfig] = None, *, model: Optional[nn.Module] = None,
                 train_data: Any = None, test_data: Any = None, loss_fn: Callable = F.cross_entropy):
        if config is not None and not isinstance(config, TrainConfig):
            raise PhalanxError(f"config must be a phalanx.TrainConfig, got {type(config).__name__}")
        if model is not None and not isinstance(model, nn.Module):
            raise PhalanxError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = config or TrainConfig()
        self.model = model
        self.loss_fn = loss_fn
        self.data = checks.user_data(train_data, test_data)

    def plan(self) -> Plan:
        """Every check that can be made before a process starts; nothing is written."""
        user_model = self.model is not None
        cfg = self.config.resolved(user_model)
        facts = checks.data_facts(cfg, self.data)
        torch.manual_seed(cfg.seed)
        model = self.model if user_model else build_model(cfg.model, facts.input_shape, facts.num_classes)
        checks.check_model(model, facts, self.loss_fn)
        devices = worker_devices(cfg)
        job = Job(tuple(devices), cfg.batch_size, cfg.accumulate, processes=_launcher_world_size(),
                  gpu_islands=_gpu_islands(devices, cfg), model=model)
        layout = cfg.strategy.layout(job)
        checks.check_global_batch(cfg, layout, facts)
        checks.check_straggler(cfg, layout)
        spawning = layout.world_size > 1 and not in_torchrun()
        if spawning:
            checks.check_main_guard()
            checks.check_sendable(self.model, self.loss_fn)
            checks.check_address(cfg.master_addr)
        checks.check_checkpoint_dir(cfg)
        checks.check_metrics_path(cfg)
        resume_path, _ = checks.check_resume(cfg, layout)
        return Plan(cfg, layout, self.model, facts.bundle, self.loss_fn, resume_path,
                    self.config.recipe_line(user_model), len(devices))

    def fit(self) -> dict[str, Any]:
        from .loop import run_worker

        plan = self.plan()
        cfg = plan.config
        created = not Path(cfg.checkpoint_dir).exists()
        ckpt.ensure_writable(cfg.checkpoint_dir)
        ckpt.remove_stale_temporaries(cfg.checkpoint_dir)
        try:
            return launch(run_worker, list(plan.layout.devices), (plan,), threads=cfg.threads, addr=cfg.master_addr,
                          timeout_s=cfg.timeout_s, tolerate=plan.layout.expendable)
        except WorkerFailed as e:
            last = ckpt.latest_checkpoint(cfg.checkpoint_dir)
            hint = f"\nlast checkpoint: {last}; continue with --resume {last}" if last else ""
            raise WorkerFailed(e.rank, e.detail + hint, plan.layout.label(e.rank)) from None
        except PhalanxError:
            if created and Path(cfg.checkpoint_dir).is_dir() and not any(Path(cfg.checkpoint_dir).iterdir()):
                Path(cfg.checkpoint_dir).rmdir()  # leave nothing behind for a run that never started
            raise


def worker_devices(cfg: TrainConfig) -> list[torch.device]:
    """One device per worker: the selected GPUs, or ``workers`` CPU slots (default 2)."""
    found = resolve_devices(cfg.devices, strict=cfg.strict_devices)
    if in_torchrun():
        return found
    if found[0].type == "cpu":
        return [torch.device("cpu")] * (cfg.workers or 2)
    workers = cfg.workers or len(found)
    if workers > len(found):
        raise PhalanxError(
            f"--workers {workers} but only {len(found)} GPU(s) selected ({', '.join(map(str, found))}); "
            "use one worker per GPU, or --devices cpu"
        )
    backend_for(found[:workers])
    return found[:workers]


def _launcher_world_size() -> Optional[int]:
    from ..launch import launcher_world_size

    return launcher_world_size()  # torchrun's WORLD_SIZE or Slurm's task count; None when phalanx spawns


def _gpu_islands(devices: list[torch.device], cfg: TrainConfig) -> Optional[tuple[tuple[int, ...], ...]]:
    """The GPU islands, where a strategy could use them (several GPUs on this machine)."""
    if len(devices) < 2 or devices[0].type != "cuda" or in_torchrun():
        return None
    from ..topology import detect_topology

    return tuple(tuple(island) for island in detect_topology(peer=True).islands())
