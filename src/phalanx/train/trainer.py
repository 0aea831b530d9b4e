"""The parent side of a training run: check everything, lay the job out, start the workers.

Read top to bottom: :meth:`Trainer.fit` builds a :class:`Plan` (every check of ``checks.py`` and ``step_checks.py``,
the strategy's layout, the model's recipe; nothing written), creates the checkpoint directory,
then launches one process per rank of the layout, each running :func:`~phalanx.train.loop.run_worker`.

    python -c "import phalanx; phalanx.Trainer(phalanx.TrainConfig(steps=200)).fit()"
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from .. import config_file
from ..launcher import startup
from ..comm import shaped_link
from ..devices import backend_for, resolve_devices
from ..errors import JobHung, PhalanxError, Stopped, WorkerFailed
from ..launcher import in_torchrun, launch, launcher_rank, launcher_world_size
from ..data.lazy import LazyExamples
from ..data.user import cast_to_model
from ..task import Task, named_optimizer, user_task
from ..strategies import Job, Layout, meta_init
from .. import checkpoint as ckpt
from . import checks, rundir, step_checks, tensorboard
from .config import TrainConfig
from .loop import run_worker
from .plan import Plan
from .result import TrainResult

log = logging.getLogger(__name__)


class Trainer:
    """Train a model with the strategy the config names; ``fit()`` returns rank 0's summary.

    Bring your own model and data: ``Trainer(config, model=net, train_data=(x, y),
    test_data=(x_test, y_test), loss_fn=F.cross_entropy, optimizer=lambda p: AdamW(p, 1e-3))``.
    ``model`` is copied to every worker (it must be picklable); data is a pair of tensors or numpy
    arrays (inputs, targets: integer classes, ``-100`` for a position no loss counts, or floats for a regression,
    MSE by default), a dict of equal-length tensors (as a tokenizer returns it), a map-style torch ``Dataset``
    whose items are pairs, tuples, dicts or nested containers of tensors, or an ``ArrayDataset``; without
    ``test_data`` a validation part is held out. A pair calls ``model(x)``, a dict ``model(**batch)``, and an
    output with a ``loss`` (a Hugging Face ``ModelOutput``) is the loss (see ``step.py``);
    ``training_step``: your ``step(model, batch) -> loss | (loss, outputs)`` for anything else.
    ``metrics``: names (``"mae"``), functions ``(outputs, targets) -> (sum, count)`` (``(outputs, batch)``
    where the second parameter is named ``batch``) or :class:`~phalanx.task.metrics.Metric` (see ``metrics.py``);
    the loss is always reported too.
    ``optimizer``: a picklable ``params -> torch.optim.Optimizer`` (module level, not a lambda, when
    workers are spawned), or ``model -> torch.optim.Optimizer`` where its first parameter is named
    ``model`` (parameter groups by name). ``lr_scheduler``: ``optimizer -> scheduler`` (with
    ``total_steps=`` where it names it), stepped once per global step in place of phalanx's schedule.
    All of it becomes one :class:`~phalanx.task.Task`.
    A script that calls ``fit()`` must do so under ``if __name__ == "__main__":`` (workers are
    spawned and import the script again).
    ``task``: a :class:`~phalanx.task.Task` built already (a comparison builds one and trains every
    run from it), in place of the parts above.
    """

    def __init__(self, config: Optional[TrainConfig] = None, *, model: Optional[nn.Module] = None,
                 train_data: Any = None, test_data: Any = None, loss_fn: Optional[Callable] = None,
                 optimizer: Optional[Callable[[Any], torch.optim.Optimizer]] = None, metrics: Any = None,
                 task: Optional[Task] = None, lr_scheduler: Optional[Callable[..., Any]] = None,
                 training_step: Optional[Callable] = None):
        if config is not None and not isinstance(config, TrainConfig):
            raise PhalanxError(f"config must be a phalanx.TrainConfig, got {type(config).__name__}")
        config = config or TrainConfig()
        if task is not None:
            parts = [name for name, value in (("model", model), ("train_data", train_data), ("test_data", test_data),
                                              ("loss_fn", loss_fn), ("optimizer", optimizer), ("metrics", metrics),
                                              ("lr_scheduler", lr_scheduler), ("training_step", training_step))
                     if value is not None]
            if parts:
                raise PhalanxError(f"task= holds the model, data, loss, optimizer and metrics already, and {parts[0]}= "
                                   f"names one again: give task= alone, or the parts without it")
            self.task = task
        else:
            self.task = user_task(config, model=model, train_data=train_data, test_data=test_data, loss_fn=loss_fn,
                                  optimizer=optimizer, metrics=metrics, lr_scheduler=lr_scheduler,
                                  training_step=training_step)
        self.config = named_optimizer(config, self.task)

    def plan(self, began: Optional[float] = None) -> Plan:
        """Every check that can be made before a process starts; nothing is written. ``began``: when
        the run began (for its start-up marks; default: now)."""
        began = time.time() if began is None else began
        task = self.task
        cfg = rundir.placed(self.config.resolved(task.model_name))  # the run's directory named, once, here
        facts = checks.data_facts(cfg, task.data)
        torch.manual_seed(cfg.seed)
        model = task.make_model(facts.input_shape, facts.num_classes)
        if task.data is not None:  # float64 numpy inputs meet float32 parameters: cast once, here
            facts = checks.data_facts(cfg, cast_to_model(task.data, model))
        step_checks.check_model(model, facts, task.loss_fn, task.metrics, task.step)
        step_checks.check_optimizer(task, model, cfg.total_steps)
        devices = worker_devices(cfg)
        job = Job(tuple(devices), cfg.batch_size, cfg.accumulate, processes=launcher_world_size(),
                  gpu_islands=_gpu_islands(devices, cfg), model=model)
        layout = cfg.options.layout(job)
        # the strategy's first step (a split forward, a tp plan), tried on a copy of the model
        cfg.options.rehearse(model, facts.example, task.step)
        checks.check_global_batch(cfg, layout, facts)
        checks.check_straggler(cfg, layout)
        if cfg.options.builds_on_meta():
            meta_init.check_run(cfg.init_from, cfg.straggler,
                                lambda: task.make_model(facts.input_shape, facts.num_classes))
        checks.check_precision(cfg, layout)
        checks.check_async_checkpoint(cfg, layout)
        if cfg.link_rate is not None:
            shaped_link.check(cfg.link_rate, devices=list(layout.devices), world_size=layout.world_size,
                              addr=cfg.master_addr, joined=in_torchrun())
        spawning = layout.world_size > 1 and not in_torchrun()
        if spawning:
            checks.check_main_guard()
            checks.check_sendable(task)
            checks.check_address(cfg.master_addr)
        checks.check_checkpoint_dir(cfg)
        checks.check_metrics_path(cfg)
        tensorboard.check(cfg.tensorboard)
        cfg = checks.check_init(cfg, model)
        claim = rundir.claim(cfg)  # a new run, a --resume, or torchrun's restarted attempt of this run
        if claim.resume != cfg.resume:  # a restarted attempt continues its run, whatever its flags say
            cfg = dataclasses.replace(cfg, resume=claim.resume, overwrite=False)
        resume_path, _, resumed = checks.check_resume(cfg, layout, task, model, restarted=claim.restarted)
        run_id = resumed or claim.run_id
        remove = claim.remove + rundir.check_metrics(cfg, run_id, new=cfg.resume is None and not claim.restarted)
        remove += rundir.cut_record(cfg, resume_path)
        return Plan(cfg, layout, dataclasses.replace(task, data=None), facts.bundle, resume_path,
                    self.config.recipe_line(task.model_name), len(devices), run_id, remove, began,
                    round(time.time() - began, 4))

    def fit(self) -> Optional[TrainResult]:
        began = startup.run_began()
        try:
            plan = self.plan(began)
        except rundir.RunComplete as done:  # a restarted attempt after the run's last checkpoint
            if launcher_rank() == 0:
                print(done, flush=True)
            return TrainResult.complete(done.step, done.path, self.config.metrics)
        cfg = plan.config
        created = not Path(cfg.run_dir).exists()
        made_runs = Path(cfg.run_dir).parent == Path(rundir.RUNS) and not Path(rundir.RUNS).exists()
        ckpt.ensure_writable(cfg.run_dir)
        # One job per checkpoint directory: the process that writes the checkpoints holds the lock.
        lock = ckpt.DirectoryLock(cfg.run_dir) if launcher_rank() == 0 else None
        try:
            if lock is not None:
                lock.acquire()
                rundir.record_run(cfg.run_dir, plan.run_id, plan.remove)  # only the checkpoint writer
                # the run as a file: --config of it repeats the run (a resume writes what it resolved now)
                config_file.write(Path(cfg.run_dir) / config_file.SAVED_NAME, cfg.to_toml())
            ckpt.remove_stale_temporaries(cfg.run_dir)
            with shaped_link.shaped(cfg.link_rate) as link:  # --link: the whole job on the shaped loopback
                summary = self._run_restarting(plan)
                if link is not None:  # read in the namespace: its loopback counted exactly this job's bytes
                    summary = link.record(summary, cfg.metrics, _steps_made(summary, plan))
        except PhalanxError:
            if created and lock is not None and lock.fd is not None:
                _remove_if_empty(Path(cfg.run_dir))  # leave nothing behind for a run that never started
                if made_runs and not any(Path(rundir.RUNS).iterdir()):
                    Path(rundir.RUNS).rmdir()  # (runs/ too, where this run made it)
            raise
        finally:
            if lock is not None:
                lock.release()
        if summary is not None and summary.get("stopped_by"):
            raise Stopped(f"stopped at step {summary['steps']} by {summary['stopped_by']}; checkpoint "
                          f"{summary['checkpoint']}", summary["stopped_by"], summary)
        return None if summary is None else TrainResult.from_summary(summary)

    def _run_restarting(self, plan: Plan) -> Optional[dict[str, Any]]:
        """Launch; when a worker dies or the job hangs, start every worker again from the newest
        checkpoint (up to --max-restarts times): exact resume makes the result the uninterrupted one."""
        cfg, restarts = plan.config, 0
        while True:
            try:
                return launch(run_worker, list(plan.layout.devices), (plan,), threads=cfg.threads,
                              addr=cfg.master_addr, timeout_s=max(cfg.timeout_s, 2 * cfg.hang_timeout_s),
                              tolerate=plan.layout.expendable, hang_timeout_s=cfg.hang_timeout_s,
                              label=plan.layout.label, lockstep=plan.layout.lockstep,
                              survivors_save=cfg.options.survivors_save, loader_modules=_loader_modules(self.task.data),
                              compiles=cfg.compile)
            except (WorkerFailed, JobHung) as e:
                newest = ckpt.latest_checkpoint(cfg.run_dir)
                if restarts >= cfg.max_restarts:
                    if isinstance(e, JobHung):
                        raise
                    hint = f"\nlast checkpoint: {newest}; continue with --resume {newest}" if newest else ""
                    raise WorkerFailed(e.rank, e.detail + hint, plan.layout.label(e.rank)) from None
                point = self._restart_point(cfg, plan.run_id)
                if point is not None and point["step"] >= cfg.steps:  # it died after the last checkpoint
                    print(f"{_what_failed(e, plan.layout)}; {rundir.RunComplete(point['step'], point['path'])}",
                          flush=True)
                    return TrainResult.complete(point["step"], point["path"], cfg.metrics).to_dict()
                restarts += 1
                plan = dataclasses.replace(plan, resume_path=point["path"] if point else None)
                where = f"checkpoint step {point['step']}" if point else "the start (no checkpoint yet)"
                where += " (the survivors' save)" if point and "survivors" in point else ""
                log.warning("%s; restart %s of %s from %s", _what_failed(e, plan.layout), restarts, cfg.max_restarts,
                            where)

    @staticmethod
    def _restart_point(cfg: TrainConfig, run_id: str) -> Optional[dict[str, Any]]:
        """This run's newest checkpoint that verifies (None: none yet, start again from step 0). Only
        this run's: the directory was claimed for it before the first launch, and is locked."""
        record = ckpt.read_run(cfg.run_dir)
        if record is None or record.run_id != run_id or not ckpt.list_checkpoints(cfg.run_dir):
            return None
        return ckpt.load_checkpoint(cfg.run_dir)


def _loader_modules(data: Any) -> Optional[list[str]]:
    """Where the ranks read a Dataset with DataLoader workers (``--loader-workers``), the modules that define it:
    each rank forks its loader workers' fork server as it starts, and the server imports them once. Else None."""
    lazy = [s for s in (getattr(data, "train", None), getattr(data, "test", None)) if isinstance(s, LazyExamples)]
    return sorted({s.module for s in lazy}) if lazy and any(s.workers for s in lazy) else None


def _steps_made(summary: Optional[dict[str, Any]], plan: Plan) -> int:
    """Steps this job advanced the run by (a resumed run started at its checkpoint's step)."""
    if summary is None or plan.resume_path is None:
        return summary["steps"] if summary else 0
    start = ckpt.step_of(plan.resume_path)  # phalanx names its checkpoints by step
    if start is None:
        start = int(ckpt.load_checkpoint(plan.resume_path)["step"])
    return summary["steps"] - start


def _what_failed(e: WorkerFailed | JobHung, layout: Layout) -> str:
    """``worker 1 died at step 57 (SIGKILL)`` / ``the job hung``: the restart line's first half."""
    if isinstance(e, JobHung):
        return f"the job hung ({str(e).split(': ', 1)[-1].splitlines()[0]})"
    at = f" at step {e.step}" if e.step is not None else ""
    detail = e.detail.strip().splitlines()
    how = re.search(r"killed by (\w+)", detail[0]) if detail else None
    why = how.group(1) if how else (detail[-1][:120] if detail else "no report")
    return f"{layout.label(e.rank)} died{at} ({why})"


def _remove_if_empty(root: Path) -> None:
    """Remove a checkpoint directory this run created, if nothing but its lock, run record and config is in it."""
    ours = (ckpt.LOCK_NAME, ckpt.RUN_NAME, config_file.SAVED_NAME)
    if root.is_dir() and all(p.name in ours for p in root.iterdir()):
        for name in ours:
            (root / name).unlink(missing_ok=True)
        root.rmdir()


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


def _gpu_islands(devices: list[torch.device], cfg: TrainConfig) -> Optional[tuple[tuple[int, ...], ...]]:
    """The GPU islands, where a strategy could use them (several GPUs on this machine)."""
    if len(devices) < 2 or devices[0].type != "cuda" or in_torchrun():
        return None
    from ..topology import detect_topology

    return tuple(tuple(island) for island in detect_topology(peer=True).islands())
