"""The training loop. It knows nothing about parallelism: the strategy wraps model and optimizer.

Read top to bottom: :class:`Trainer` (in the calling process) checks the configuration, the
devices, the data files, the checkpoint directory and the checkpoint to resume from, then
launches one worker per device; each worker runs :func:`run_worker`: build model and data,
let the strategy wrap them, restore a checkpoint, and loop over global steps.

    python -c "import phalanx; phalanx.Trainer(phalanx.TrainConfig(steps=200)).fit()"
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..data.datasets import DATASETS, check_cifar10_files
from ..data import ArrayDataset, DataBundle, Prefetcher, ShardedBatches, eval_batches, load_data
from ..devices import backend_for, resolve_devices
from ..errors import PhalanxError, TrainingDiverged, WorkerFailed
from ..launch import WorkerContext, in_torchrun, launch, world_size
from ..models import build_model
from . import checkpoint as ckpt
from .config import TrainConfig
from .report import Reporter, step_line
from .schedules import Schedule, scaled_lr


@dataclasses.dataclass
class Plan:
    """Everything a worker needs, checked in the parent and sent (pickled) to every worker."""

    config: TrainConfig
    devices: list
    model: Optional[nn.Module]  # the user's model object, or None for a built-in one
    data: Optional[DataBundle]  # the user's data, or None for a built-in set
    loss_fn: Callable
    resume_path: Optional[str]
    start_step: int


class Trainer:
    """Train a model with the strategy the config names; ``fit()`` returns rank 0's summary.

    Bring your own model and data: ``Trainer(config, model=net, train_data=(x, y),
    test_data=(x_test, y_test))``. ``model`` is copied to every worker (it must be picklable);
    data is a pair of tensors (inputs, integer labels) or an :class:`ArrayDataset`.
    """

    def __init__(self, config: Optional[TrainConfig] = None, *, model: Optional[nn.Module] = None,
                 train_data: Any = None, test_data: Any = None, loss_fn: Callable = F.cross_entropy):
        self.config = config or TrainConfig()
        self.model = model
        self.loss_fn = loss_fn
        self.data = _user_data(train_data, test_data)

    def fit(self) -> dict[str, Any]:
        cfg = self.config
        devices = cfg.strategy.plan_devices(worker_devices(cfg))
        cfg.strategy.check_world(world_size(devices), devices)
        cfg.strategy.check_batch(cfg.batch_size, cfg.accumulate)
        data = self.data if self.data is not None else _check_data_files(cfg)
        resume_path, start_step = _check_resume(cfg, world_size(devices))
        created = not Path(cfg.checkpoint_dir).exists()
        ckpt.ensure_writable(cfg.checkpoint_dir)
        ckpt.remove_stale_temporaries(cfg.checkpoint_dir)
        plan = Plan(cfg, devices, self.model, data, self.loss_fn, resume_path, start_step)
        try:
            return launch(run_worker, devices, (plan,), threads=cfg.threads, addr=cfg.master_addr,
                          timeout_s=cfg.timeout_s, tolerate=cfg.strategy.tolerates_loss_of)
        except WorkerFailed as e:
            last = ckpt.latest_checkpoint(cfg.checkpoint_dir)
            hint = f"\nlast checkpoint: {last}; continue with --resume {last}" if last else ""
            raise WorkerFailed(e.rank, e.detail + hint, cfg.strategy.role(e.rank)) from None
        except PhalanxError:
            if created and not any(Path(cfg.checkpoint_dir).iterdir()):
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


def _user_data(train: Any, test: Any) -> Optional[DataBundle]:
    if train is None:
        return None
    as_ds = lambda d: d if isinstance(d, ArrayDataset) else ArrayDataset(*d)  # noqa: E731
    train_ds = as_ds(train)
    test_ds = as_ds(test) if test is not None else train_ds
    classes = int(max(train_ds.y.max(), test_ds.y.max())) + 1
    return DataBundle("user", train_ds, test_ds, tuple(train_ds.x.shape[1:]), classes)


def _check_data_files(cfg: TrainConfig) -> None:
    """Fail in the parent (exit 2, one line) before any worker starts, e.g. a missing CIFAR file."""
    if cfg.data == "cifar10":
        check_cifar10_files(cfg.data_dir)
    elif cfg.data not in DATASETS:
        raise PhalanxError(f"unknown data set {cfg.data!r}: choose one of {', '.join(DATASETS)}")
    return None


def _check_resume(cfg: TrainConfig, workers: int) -> tuple[Optional[str], int]:
    if cfg.resume is None:
        return None, 0
    state = ckpt.load_checkpoint(cfg.resume)
    meta = state.get("meta", {})
    want = {"world_size": workers, "batch_size": cfg.batch_size, "model": cfg.model, "data": cfg.data,
            "strategy": cfg.strategy.name}
    for key, value in want.items():
        if key in meta and meta[key] != value:
            raise PhalanxError(
                f"checkpoint {state['path']} was written with {key} = {meta[key]!r} but this run has "
                f"{value!r}; resume with the same settings (--{key.replace('_', '-')} {meta[key]})"
            )
    if state["step"] >= cfg.steps:
        raise PhalanxError(
            f"checkpoint {state['path']} is already at step {state['step']} and --steps is {cfg.steps}; "
            "raise --steps to train further"
        )
    return state["path"], int(state["step"])


# --------------------------------------------------------------------------- inside a worker


def run_worker(ctx: WorkerContext, plan: Plan) -> dict[str, Any]:
    run = WorkerRun(ctx, plan)
    try:
        return run.train()
    finally:
        run.close()


class WorkerRun:
    """One worker's share of the run."""

    def __init__(self, ctx: WorkerContext, plan: Plan):
        self.ctx, self.plan, self.cfg = ctx, plan, plan.config
        self.strategy = copy.deepcopy(self.cfg.strategy)
        self.data = plan.data or load_data(self.cfg.data, self.cfg.data_dir, tuple(self.cfg.synthetic_shape),
                                           self.cfg.synthetic_size, self.cfg.seed)
        # Which share of each global step this worker reads (a pipeline's stages all read the same).
        self.shard, self.shards = self.strategy.data_shard(ctx)
        self.global_batch = self.cfg.batch_size * self.shards
        self.batches = ShardedBatches(self.data.train, self.cfg.batch_size, self.shard, self.shards, self.cfg.seed)
        self.strategy.example_batch(*next(self.batches(0)))
        model = self._build_model().to(ctx.device)
        self.strategy.total_steps = self.cfg.steps
        self.model, self.optimizer = self.strategy.setup(ctx, model, self._make_optimizer)
        self.schedule = Schedule(self.cfg.lr_schedule, self.cfg.lr_decay_every, self.cfg.lr_decay_factor,
                                 self.cfg.staircase, self.cfg.warmup_steps, self.cfg.steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        # A parameter server's workers never step their own optimizer (the server does): torch
        # would warn on every step that the schedule advances before the optimizer.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        self.step = 0
        self.last_checkpoint: Optional[str] = None
        if plan.resume_path:
            self._restore(plan.resume_path)
        self.reporter = Reporter(ctx.is_main, self.cfg.progress, self.cfg.metrics, self.cfg.steps, self.step,
                                 append=plan.resume_path is not None)
        self.prefetcher: Optional[Prefetcher] = None

    def _build_model(self) -> nn.Module:
        torch.manual_seed(self.cfg.seed)  # the same initial weights on every worker
        if self.plan.model is not None:
            return copy.deepcopy(self.plan.model)
        return build_model(self.cfg.model, self.data.input_shape, self.data.num_classes)

    def _make_optimizer(self, params) -> torch.optim.Optimizer:
        lr = scaled_lr(self.cfg.lr, self.global_batch, self.cfg.lr_base_batch)
        if self.cfg.optimizer == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=self.cfg.weight_decay)
        return torch.optim.SGD(params, lr=lr, momentum=self.cfg.momentum, weight_decay=self.cfg.weight_decay)

    # ---- the loop ----
    def train(self) -> dict[str, Any]:
        self._header()
        self.prefetcher = Prefetcher(self.batches(self.step), self.ctx.device, self.cfg.prefetch)
        start, first_step = time.perf_counter(), self.step
        mark, mark_step = start, self.step
        while self.step < self.cfg.steps:
            x, y = next(self.prefetcher)
            began = time.perf_counter()
            loss = self.strategy.train_step(x, y, self.plan.loss_fn, self.cfg.accumulate)
            self._straggle(time.perf_counter() - began)
            self.scheduler.step()
            value = float(self.strategy.global_loss(loss))
            following = self.strategy.next_step(self.step)
            if following is None:  # an asynchronous worker told to stop
                break
            self.step = following
            self._guard(value)
            self.reporter.advance(value)
            if self.step % self.cfg.log_every == 0 or self.step == self.cfg.steps:
                now = time.perf_counter()
                self._log(value, self.step - mark_step, now - mark)
                mark, mark_step = now, self.step
            if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 and self.step < self.cfg.steps:
                self._evaluate()
            if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
                self._save()
        self.strategy.finish()
        elapsed = time.perf_counter() - start
        accuracy = self._evaluate()
        if self.last_checkpoint is None or not self.last_checkpoint.endswith(f"{self.step:08d}.pt"):
            self._save()
        return self._summary(accuracy, self.step - first_step, elapsed)

    def _straggle(self, seconds: float) -> None:
        """--straggler RANK:FACTOR: this rank takes FACTOR times as long (sleeps the difference)."""
        if self.cfg.straggler is not None and self.cfg.straggler[0] == self.ctx.rank:
            time.sleep((self.cfg.straggler[1] - 1) * seconds)

    def _guard(self, loss: float) -> None:
        # Every rank holds the same all-reduced loss, so every rank stops at the same step.
        if not math.isfinite(loss):
            self._diverged(loss)

    def _diverged(self, loss: float) -> None:
        last = self.last_checkpoint or "none (no checkpoint was written before this step)"
        self.reporter.record("diverged", step=self.step, loss=str(loss))
        raise TrainingDiverged(
            f"model diverged with loss = {loss} at step {self.step}; last good checkpoint: {last} "
            "(lower --lr or add --warmup-steps, then --resume from it)"
        )

    def _log(self, loss: float, steps: int, seconds: float) -> None:
        rate = steps * self.global_batch / max(seconds, 1e-9)
        per_batch = seconds / max(steps, 1)
        self.reporter.say(step_line(self.step, loss, rate, per_batch))
        self.reporter.record("step", step=self.step, loss=loss, lr=self.scheduler.get_last_lr()[0],
                             examples_per_sec=rate, sec_per_batch=per_batch, **self.strategy.stats())

    def _evaluate(self) -> float:
        correct, total = self.strategy.evaluate(
            eval_batches(self.data.test, 256, *self.strategy.eval_shard(self.ctx)), self.ctx.device
        )
        accuracy = correct / max(total, 1)
        self.reporter.record("eval", step=self.step, accuracy=accuracy, examples=total)
        if self.step < self.cfg.steps:
            self.reporter.say(f"step {self.step}, test accuracy = {accuracy:.4f}")
        return accuracy

    # ---- checkpoints ----
    def _save(self) -> None:
        # The loss of this step was finite, but its update may not be: never save such weights.
        if not all(torch.isfinite(p).all() for p in self.strategy.module.parameters()):
            self._diverged(float("nan"))
        state = self.strategy.checkpoint_state()
        rng = [torch.get_rng_state()]
        if self.ctx.distributed and self.strategy.lockstep:
            gathered: list = [None] * self.ctx.world_size
            dist.all_gather_object(gathered, rng[0])
            rng = gathered
        path = str(ckpt.checkpoint_path(self.cfg.checkpoint_dir, self.step))
        if self.ctx.is_main and state is not None:
            ckpt.save_checkpoint(
                {"format": "phalanx-checkpoint-1", "step": self.step, **state,
                 "scheduler": self.scheduler.state_dict(), "rng": rng, "meta": self._meta(),
                 "data_position": {"epoch": self.step // self.batches.steps_per_epoch,
                                   "batch_in_epoch": self.step % self.batches.steps_per_epoch}},
                self.cfg.checkpoint_dir, self.step, self.cfg.keep_checkpoints,
            )
            self.reporter.record("checkpoint", step=self.step, path=path)
        self.last_checkpoint = path

    def _meta(self) -> dict[str, Any]:
        return {"world_size": self.ctx.world_size, "batch_size": self.cfg.batch_size, "model": self.cfg.model,
                "data": self.cfg.data, "strategy": self.strategy.name, "seed": self.cfg.seed,
                "input_shape": list(self.data.input_shape), "num_classes": self.data.num_classes}

    def _restore(self, path: str) -> None:
        state = ckpt.load_checkpoint(path)
        self.strategy.load_state(state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        rng = state.get("rng") or []
        if self.ctx.rank < len(rng):
            torch.set_rng_state(rng[self.ctx.rank])
        self.last_checkpoint = state["path"]

    # ---- what rank 0 prints ----
    def _header(self) -> None:
        devs = sorted({str(d) for d in self.plan.devices})
        backend = self.ctx.backend or "none (one process)"
        resumed = f", resuming at step {self.step}" if self.step else ""
        self.reporter.say(
            f"phalanx train: strategy {self.strategy.describe()}, world size {self.ctx.world_size}, devices "
            f"{', '.join(devs)}, backend {backend}, global batch {self.global_batch} "
            f"({self._batch_split()}), {self.cfg.model} on {self.data.name}{resumed}"
        )
        for line in self.strategy.header_lines():
            self.reporter.say(line)

    def _batch_split(self) -> str:
        if self.shards == self.ctx.world_size:
            return f"{self.cfg.batch_size} per worker x {self.ctx.world_size}"
        if self.shards == 1:
            return "every worker reads the whole batch"
        return f"{self.cfg.batch_size} per data shard x {self.shards}"

    def _summary(self, accuracy: float, steps: int, seconds: float) -> dict[str, Any]:
        rate = steps * self.global_batch / max(seconds, 1e-9)
        summary = {"steps": self.step, "test_accuracy": accuracy, "examples_per_sec": rate,
                   "train_seconds": seconds, "checkpoint": self.last_checkpoint, "metrics": self.cfg.metrics,
                   "world_size": self.ctx.world_size, "strategy": self.strategy.name,
                   **self.strategy.stats(final=True)}
        self.reporter.record("summary", **summary)
        self.reporter.close()
        self.reporter.say(f"test accuracy {accuracy:.4f} after {self.step} steps")
        self.reporter.say(f"throughput {rate:.1f} examples/sec (global), training time {seconds:.1f} s")
        for line in self.strategy.summary_lines():
            self.reporter.say(line)
        self.reporter.say(f"checkpoint {self.last_checkpoint}")
        self.reporter.say(f"metrics {self.cfg.metrics}")
        return summary

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.strategy.close()
        self.reporter.close()
