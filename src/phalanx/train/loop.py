"""Inside a worker: the training loop. It knows nothing about parallelism.

:func:`run_worker` builds this rank's data and model, lets the strategy's runtime wrap them,
restores a checkpoint, and loops over global steps. The runtime is the only thing that knows the
strategy; the loop calls its few methods (see ``strategies/base.py``) the same way for all.
"""

from __future__ import annotations

import itertools
import time
import warnings
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..data import Prefetcher, ShardedBatches, eval_batches, load_data
from ..data.loader import Position, advance, prefetch_depth
from ..errors import TrainingDiverged
from ..launcher import WorkerContext
from ..memory import Held, describe, held, largest
from ..task.metrics import Totals, said
from ..comm.shaped_link import loopback_bytes
from ..comm.wire import Meter, metering, summary_fields, summary_line
from ..task import is_import_path, resolve
from ..data.batch import split, to_device
from ..precision import Precision, compile_blocks
from ..recompute import Recomputed, checkpoint_blocks
from ..shard_read import ALIASES
from ..launcher.startup import Marks
from ..strategies import Build, meta_init, nonfinite_values
from . import checkpoint as ckpt
from .losses import LossWindow, first_non_finite
from .step_errors import explained
from .report import Reporter, step_line
from .resume import check_fits, data_position, restore_settings, resume_config, settings_line, settings_of
from ..task.schedules import Schedule
from .sharded import ShardWriter
from ..scenarios.straggle import Straggle
from .trainer import Plan

#: How often (in steps) every rank reads the job's stop request from the store at first; at least 2, so
#: that ranks in step (at most one apart) never pass the stop step the first reader proposes.
STOP_CHECK_EVERY = 4
#: After PACE_STEPS steps the ranks agree on a new count of steps between reads, about STOP_CHECK_S
#: seconds of steps (at least STOP_CHECK_EVERY, at most STOP_CHECK_MAX): a read is a round trip to the
#: store, 100-220 us on 2 loaded cores. Measured on 2 such cores (the digits mlp, 2 workers, 4
#: interleaved runs each): local SGD without averaging 0.838 -> 0.804 ms a step; sync unchanged.
PACE_STEPS, STOP_CHECK_S, STOP_CHECK_MAX = 32, 0.05, 256
STOP_KEY, STOP_AT_KEY, CADENCE_KEY = "phalanx/stop", "phalanx/stop_at", "phalanx/stop_check_every"


def run_worker(ctx: WorkerContext, plan: Plan) -> dict[str, Any]:
    with metering() as meter:  # every collective and message of this process, priced (wire.py)
        run = WorkerRun(ctx, plan, meter)
        try:
            return run.train()
        finally:
            run.close()


class WorkerRun:
    """One rank's share of the run."""

    def __init__(self, ctx: WorkerContext, plan: Plan, meter: Optional[Meter] = None):
        self.ctx, self.plan, self.cfg = ctx, plan, plan.config
        self.marks = Marks(plan.began, plan=plan.planned)  # where the start-up's seconds go
        self.marks.mark("joined")
        self.meter = meter or Meter()  #: this rank's bytes on the wire in the training steps
        # On a shaped link (--link) rank 0 also reads the loopback's own counters at both ends of the steps.
        self.link_at: list[int] = []
        self.me = plan.layout.ranks[ctx.rank]
        # A checkpoint's settings fill in what no flag gave, before anything is built from the config.
        # (verify=False: the plan verified every shard of a sharded checkpoint; a file is verified as it loads)
        resumed = ckpt.load_checkpoint(plan.resume_path, verify=False) if plan.resume_path else None
        self.resumed = resume_config(self.cfg, resumed, plan.layout.shards) if resumed else None
        cfg = self.cfg = self.resumed.config if self.resumed else self.cfg
        self.data = plan.data or load_data(cfg.data, cfg.data_dir, tuple(cfg.synthetic_shape), cfg.synthetic_size,
                                           cfg.seed)
        self.marks.mark("data")
        self.global_batch = cfg.batch_size * plan.layout.shards
        # This rank's share of every global step (None: it reads no data, e.g. a parameter server).
        self.batches = None if self.me.shard is None else ShardedBatches(
            self.data.train, cfg.batch_size, self.me.shard, plan.layout.shards, cfg.seed)
        # Where the data stood at step start_step: positions count examples, so the global batch may change.
        self.start_step, self.start_position = 0, Position(0, 0)
        example = self.batches.one(0) if self.batches is not None else None
        model = self._build_model()
        if not meta_init.on_meta(model):  # (on meta: the strategy's runtime materialises its shards)
            model = model.to(ctx.device)
        self.model_class = f"{type(model).__module__}.{type(model).__qualname__}"  # recorded in checkpoints
        if resumed:  # before any strategy wraps it: the plain model's names are the checkpoint's
            check_fits(resumed, model, resumed["path"])
        self.init_line = self._init_from(model) if cfg.init_from and not resumed else None
        # In place, before compiling and before any strategy wraps the model (torchtitan's order).
        self.recomputed = self._checkpoint_activations(model, example) if cfg.activation_checkpointing else None
        self.compiled = compile_blocks(model) if cfg.compile else 0  # in place: before any strategy wraps it
        self.marks.mark("model")
        # Before the runtime: calibrating shares every rank's compute time (a collective).
        self.straggle = Straggle.start(cfg.straggler, ctx, self.me.shard, model, example, plan.task.step,
                                       cfg.accumulate, cfg.seed)
        self.marks.mark("calibration")
        build = Build(ctx, plan.layout, model, self._make_optimizer, plan.task.loss_fn, cfg.steps, cfg.accumulate, example,
                      cfg.hang_timeout_s, Precision(cfg.precision, ctx.device.type), cfg.clip_grad_norm,
                      plan.task.step)
        self.runtime = cfg.strategy.runtime(build)
        # Each rank writes its own shard of a checkpoint where the runtime holds one (else rank 0 one file).
        self.shard_writer = ShardWriter(ctx, cfg.async_checkpoint) if self.runtime.writes_shards else None
        self.checkpoint_blocked_s = 0.0  #: the seconds checkpoints held the training up (on this rank)
        self.marks.mark("strategy")
        self.schedule = Schedule(cfg.lr_schedule, cfg.lr_decay_every, cfg.lr_decay_factor, cfg.staircase,
                                 cfg.warmup_steps, cfg.steps)
        # A parameter server's workers never step their own optimizer (the server does): torch
        # would warn on every step that the schedule advances before the optimizer.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        self.step = 0
        self.stop_at: Optional[int] = None  # the step every rank stops at, once a stop was requested
        self.stop_name: Optional[str] = None  # the signal that asked for it (on whichever rank it reached)
        self.published_stop = False
        #: steps between stop checks, counted from ``check_from`` (every rank the same; see _check_due)
        self.check_every, self.check_from, self.paced = STOP_CHECK_EVERY, 0, False
        self.loop_began = 0.0
        self.last_checkpoint: Optional[str] = None
        self.saved_step: Optional[int] = None  #: the step of the last checkpoint (written or resumed from)
        if resumed:
            self._restore(resumed)
        self.scheduler = self._scheduler(resumed)
        # What each step steps: nothing under a constant schedule of phalanx's own (its multiplier is 1 at every
        # step; the scheduler, built all the same, set the learning rate a resume starts from).
        own_constant = self.plan.task.make_scheduler is None and self.schedule.constant
        self.stepped_scheduler = None if own_constant else self.scheduler
        # The first param group, whose lr the metrics file logs: held, so that a step reads it in one lookup
        # (the optimizer's groups are replaced only by a load, done above).
        self.lr_group = self.runtime.optimizer.param_groups[0]
        self.lr = self.lr_group["lr"]  #: the learning rate the optimizer used in the step just taken
        self.straggle.begin(self.step)
        self.eval_seconds = 0.0  # evaluation time, kept out of the training time
        # What evaluation adds up: every metric's (sum, count), over every rank (exact, see metrics.py).
        self.totals = Totals(plan.task.metrics, plan.task.loss_fn)
        self.target = cfg.target  # what stops the run early (None: nothing)
        self.reporter = Reporter(ctx.is_main, cfg.progress, cfg.metrics, cfg.steps, self.step,
                                 resumed_from=plan.resume_path, run_id=plan.run_id, tensorboard=cfg.tensorboard)
        self.prefetcher: Optional[Prefetcher] = None

    def _build_model(self) -> nn.Module:
        torch.manual_seed(self.cfg.seed)  # the same initial weights on every worker
        with meta_init.building(self.cfg.strategy.builds_on_meta()):
            return self.plan.task.make_model(self.data.input_shape, self.data.num_classes)

    def _init_from(self, model: nn.Module) -> str:
        """Fine-tuning (--init-from): the checkpoint's weights, loaded into the plain model on every rank (so the
        replicas start equal) before a strategy wraps it; its optimizer, step and data position are not taken."""
        # (the plan verified it and checked that it fits; a sharded checkpoint's shards are read whole here)
        state = ckpt.tensors(ckpt.load_checkpoint(self.cfg.init_from, "--init-from", verify=False), optimizer=False)
        model.load_state_dict(state["model"])
        return (f"starting from the weights of {state['path']} (step {state['step']}), with a fresh optimizer and "
                "schedule from step 0")

    def _checkpoint_activations(self, model: nn.Module, example: Any) -> Recomputed:
        """--activation-checkpointing on the strategy's blocks; rank 0 measures what it saves on its first
        micro-batch (two forwards, nothing changed: see recompute.py)."""
        units = self.cfg.strategy.units(model)
        if any(p.is_meta for p in model.parameters()):  # (--init-device meta: nothing to run a forward on yet)
            return checkpoint_blocks(model, units, None, unmeasured="the model is built on the meta device")
        if not self.ctx.is_main or example is None:
            return checkpoint_blocks(model, units, None)
        batch = to_device(split(example, self.cfg.accumulate)[0], self.ctx.device)
        precision = Precision(self.cfg.precision, self.ctx.device.type)

        def measure() -> Any:
            with precision.autocast():
                return self.plan.task.step(model, batch).loss
        return checkpoint_blocks(model, units, measure)

    def _make_optimizer(self, module: nn.Module) -> torch.optim.Optimizer:
        task = self.plan.task
        if task.make_optimizer is None and is_import_path(self.cfg.optimizer):  # a checkpoint's, on --resume
            task.make_optimizer = resolve(self.cfg.optimizer, "--optimizer", "params -> torch.optim.Optimizer")
        return task.optimizer_for(self.cfg, module, self.global_batch)

    def _scheduler(self, resumed: Optional[dict[str, Any]]) -> Optional[Any]:
        """The run's LR scheduler on the optimizer that applies the updates (None on a rank whose optimizer
        never steps: a parameter server's worker, whose server's scheduler is the run's).

        The user's (``--lr-scheduler``) continues from the checkpoint's state where it has one, and the
        optimizer's learning rates are put back to where that state left them (a chainable scheduler, e.g.
        StepLR, reads them). phalanx's own is a pure function of the step: the step alone puts it where it
        was, under the settings in force now (a checkpoint's scheduler state would bring back its old ones)."""
        if not self.runtime.steps_optimizer:
            return None
        optimizer, task = self.runtime.optimizer, self.plan.task
        if task.make_scheduler is None and self.cfg.lr_scheduler:  # a checkpoint's, on --resume
            task.make_scheduler = resolve(self.cfg.lr_scheduler, "--lr-scheduler", "optimizer -> LR scheduler")
        if task.make_scheduler is None:
            return torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule, last_epoch=self.step - 1)
        scheduler = task.scheduler(optimizer, self.cfg.steps)
        saved = (resumed or {}).get("lr_scheduler")
        if saved is not None:
            scheduler.load_state_dict(saved)
            for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
        return scheduler

    def _inputs(self) -> Iterator:
        if self.batches is None:
            return itertools.repeat(None)
        self.prefetcher = Prefetcher(self.batches(self._position()), self.ctx.device,
                                     prefetch_depth(self.cfg.prefetch, self.ctx.device))
        return self.prefetcher

    # ---- the loop ----
    def train(self) -> dict[str, Any]:
        self._header()
        inputs = self._inputs()
        start, first_step = time.perf_counter(), self.step
        mark, mark_step = start, self.step
        progress = self.ctx.progress
        progress.handle_signals()  # from here on SIGTERM/SIGINT mean: stop at a step boundary and save
        reached = False
        # An ordinary step reads nothing on the host and runs no collective of its own: the losses
        # wait on the device until a log or checkpoint step looks at them (see losses.py).
        window = LossWindow(self.ctx.device, self.cfg.log_every)
        self.check_from, self.loop_began = self.step, time.perf_counter()  # (a resume starts every rank alike)
        self._count_wire(True)
        while self.step < self.cfg.steps and not reached:
            if self._stopping():
                break
            progress.at(self.step + 1, "the training step")
            batch = next(inputs)
            self.lr = self.lr_group["lr"]  # (read before the scheduler moves it on: the one this step uses)
            try:
                loss = self.runtime.train_step(batch)
            except RuntimeError as e:  # (free in the hot path: a try costs nothing until it catches)
                known = explained(e, self.runtime.module)
                if known is None:
                    raise
                raise known from None
            self.marks.mark("first_step")  # (the first call counts; on a GPU: when the step was queued)
            self.straggle.after_step()
            if self.stepped_scheduler is not None:
                self.stepped_scheduler.step()
            following = self.runtime.next_step(self.step)
            if following is None:  # an asynchronous worker told to stop
                break
            self.step = following
            window.add(self.step, loss)
            self.reporter.advance()
            logging = self.step % self.cfg.log_every == 0 or self.step == self.cfg.steps
            saving = bool(self.cfg.checkpoint_every) and self.step % self.cfg.checkpoint_every == 0
            if logging or saving or window.full:
                value = self._look(window)
            if logging:
                now = time.perf_counter()
                self._log(value, self.step - mark_step, now - mark)
                mark, mark_step = now, self.step
            if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 and self.step < self.cfg.steps:
                values = self._evaluate(start)
                reached = self.target is not None and self.target.reached(values)
            if saving:
                self._save()
        if len(window):  # every rank stops at the same step, holding the same steps
            self._look(window)
        progress.at(self.step, "finishing")
        # What the strategy still owes the model goes in now (a last averaging, an outer round, the
        # gradients in flight): what is printed, saved and evaluated afterwards is that one model.
        changed = self.runtime.finish()
        self._count_wire(False)
        elapsed = time.perf_counter() - start - self.eval_seconds
        stopped = self.stop_name if self.stop_at is not None and self.step >= self.stop_at else None
        if stopped:  # a stop asked for speed: save, go
            values = None
        elif changed or not reached:  # (a target reached by this step's evaluation of this model: not twice)
            values = self._evaluate(start, final=True)
        if changed or self.saved_step != self.step:
            self._save()
        self._settle()  # (the run's last checkpoint is written before its summary names it)
        return self._summary(values, self.step - first_step, elapsed, reached, stopped)

    def _count_wire(self, start: bool) -> None:
        """The training steps' window of the bytes on the wire (and of the shaped link's counters)."""
        if self.cfg.link is not None and self.ctx.is_main:
            self.link_at.append(loopback_bytes())
        if start and self.cfg.link is not None and self.ctx.distributed and self.plan.layout.lockstep:
            # Once per run, on a shaped link only: no rank sends its first step's bytes before rank 0
            # (which opens the metrics file and prints the header first) has read the link's counter.
            dist.barrier()
        if start:
            self.meter.begin()
        else:
            self.meter.end()

    def _stopping(self) -> bool:
        """Whether this rank stops before the next step: a stop was requested (SIGTERM, SIGINT to any
        process of the job) and the step the ranks agreed on is reached.

        A rank that got the signal itself publishes the request in the job's store; every rank reads
        the store at the same steps (one round trip: every :data:`STOP_CHECK_EVERY` steps, then about
        every :data:`STOP_CHECK_S` seconds of steps), so a signal to a single worker stops the whole job
        as one reaching the launcher does. Other steps cost an attribute read.
        """
        if self.stop_at is None:
            mine = self.ctx.progress.stop_requested
            if mine is not None and not self.published_stop:
                self._publish_stop(mine)
            if not self.ctx.distributed or self.ctx.store is None:
                if mine is None:
                    return False
                self.stop_name, self.stop_at = mine, self.step
            elif self._check_due():
                self.stop_at = self._agree_on_stop()
        return self.stop_at is not None and self.step >= self.stop_at

    def _check_due(self) -> bool:
        """Whether this step reads the store. Every rank reads at the same steps: every STOP_CHECK_EVERY
        from the loop's first step, until PACE_STEPS steps are done; there (a check step of every rank)
        each proposes about STOP_CHECK_S seconds of its steps so far and the first proposal stored is
        every rank's count from then on (compare_set). A proposed stop is always the next check step."""
        since = self.step - self.check_from
        if since % self.check_every:
            return False
        if not self.paced and since >= PACE_STEPS:
            per_step = (time.perf_counter() - self.loop_began) / since
            mine = max(STOP_CHECK_EVERY, min(STOP_CHECK_MAX, round(STOP_CHECK_S / max(per_step, 1e-9))))
            self.check_every = int(self.ctx.store.compare_set(CADENCE_KEY, "", str(mine)))
            self.check_from, self.paced = self.step, True
        return True

    def _publish_stop(self, name: str) -> None:
        self.published_stop = True
        if self.ctx.distributed and self.ctx.store is not None:
            self.ctx.store.compare_set(STOP_KEY, "", name)  # the first request is the one named

    def _agree_on_stop(self) -> Optional[int]:
        """At a check step: the step to stop at, once any rank published a request (None: none yet, or
        this rank is told by another when to stop)."""
        rule, store = self.plan.layout.stop_rule, self.ctx.store
        if rule == "server" and self.ctx.rank != 0:
            return None  # a parameter server's worker stops when the server tells it
        if not store.check([STOP_KEY]):
            return None
        self.stop_name = store.get(STOP_KEY).decode()
        if rule in ("each", "server"):
            return self.step
        # In step with each other, ranks are at most a step apart: every rank is at this check step or
        # beside it, and none has passed the next one, the step proposed. A rank that read the store
        # here just before the request arrived finds the proposal at that next check, where it stops.
        # The first proposal stored wins (compare_set), so every rank reads the same step.
        return int(store.compare_set(STOP_AT_KEY, "", str(self.step + self.check_every)))

    def _look(self, window: LossWindow) -> float:
        """The NaN guard over every step since the last look, on the losses every rank agrees on (so
        every rank stops at the same step); returns the newest agreed loss."""
        steps, losses = window.take(self.runtime.global_losses)
        bad = first_non_finite(steps, losses)
        if bad is not None:
            self._diverged(bad[1], bad[0])
        self.reporter.show_loss(losses[-1])
        return losses[-1]

    def _diverged(self, loss: float, step: int) -> None:
        if self.me.expendable:
            # A rank the job can lose (a parameter server's worker) holds the server's parameters and
            # writes no checkpoint: the server sees every loss and stops the job at the first bad one.
            return
        self._settle()  # the checkpoint in flight, if any, is the last good one: finished before it is named
        last = self.last_checkpoint or "none (no checkpoint was written before this step)"
        inputs = self.runtime.nonfinite_inputs(step) or self._nonfinite_inputs(step)
        self.reporter.record("diverged", step=step, loss=str(loss), **({"inputs": inputs} if inputs else {}))
        if inputs:
            raise TrainingDiverged(
                f"the inputs of step {step} contain {inputs}, so its loss is {loss}: the data, not the learning "
                f"rate, is the cause; clean or drop those examples (last good checkpoint: {last})"
            )
        raise TrainingDiverged(
            f"model diverged with loss = {loss} at step {step}; last good checkpoint: {last} "
            "(lower --lr or add --warmup-steps, then --resume from it)"
        )

    def _nonfinite_inputs(self, step: int) -> Optional[str]:
        """Whether the batches of ``step`` held NaN or infinity, read again from the data: only once a loss
        was found non-finite, so an ordinary step never pays for it. Ranks in step read every shard, so
        they all name the same one without a collective; the others, their own."""
        layout = self.plan.layout
        if self.batches is None or step < 1:
            return None
        at = advance(self.start_position, step - 1 - self.start_step, len(self.data.train), self.global_batch)
        for shard in range(layout.shards) if layout.lockstep else (self.me.shard,):
            reader = ShardedBatches(self.data.train, self.cfg.batch_size, shard, layout.shards, self.cfg.seed)
            what = nonfinite_values(reader.one(at))
            if what:
                return f"{what} (data shard {shard})"
        return None

    def _log(self, loss: float, steps: int, seconds: float) -> None:
        rate = steps * self.global_batch / max(seconds, 1e-9)
        per_batch = seconds / max(steps, 1)
        self.reporter.say(step_line(self.step, loss, rate, per_batch))
        norm = self.runtime.grad_norm  # (a host read of the device's norm: at log steps only)
        clipped = {"grad_norm": float(norm)} if norm is not None and self.ctx.is_main else {}
        self.reporter.record("step", step=self.step, loss=loss, lr=float(self.lr), **clipped,
                             examples_per_sec=rate, sec_per_batch=per_batch, **self.runtime.report().fields)

    def _evaluate(self, start: float, final: bool = False) -> dict[str, float]:
        """Every metric on the test set now, over every rank's part; its time is kept out of the training
        time (``train_seconds``: so far). The metrics file has them under ``metrics`` (and ``accuracy``
        where it is one, as before)."""
        self.ctx.progress.at(self.step, "evaluation")
        began = time.perf_counter()
        part = self.me.evaluates
        batches = eval_batches(self.data.test, 256, *part) if part is not None else iter(())
        with self.meter.aside():  # not a training step's traffic
            values = self.totals.values(self.runtime.evaluate(batches, self.totals))
        seconds = time.perf_counter() - began
        accuracy = {"accuracy": values["accuracy"]} if "accuracy" in values else {}
        self.reporter.record("eval", step=self.step, **accuracy, metrics=values, held_out=self.data.held_out,
                             train_seconds=began - start - self.eval_seconds, eval_seconds=seconds,
                             **self.runtime.report().fields)
        self.eval_seconds += seconds
        if not final:  # the summary says the final one
            self.reporter.say(f"step {self.step}, {self.data.held_out} {said(values)}")
        return values

    # ---- checkpoints ----
    def _save(self) -> None:
        began = time.perf_counter()
        with self.meter.aside():  # gathering a checkpoint is not a training step's traffic
            path = self._write_checkpoint()
        # What the step waited for: the whole save (a file; every rank's shards), or under --async-checkpoint
        # the save before it still in flight and the copy of this rank's shards to CPU memory.
        blocked = time.perf_counter() - began
        self.checkpoint_blocked_s += blocked
        if path is not None:
            self.reporter.record("checkpoint", step=self.step, path=path, checkpoint_blocked_s=round(blocked, 6),
                                 **({"in_background": True} if self.cfg.async_checkpoint else {}))

    def _settle(self) -> None:
        """Until the checkpoint in flight (--async-checkpoint) is written; its time counts as blocked."""
        if self.shard_writer is not None and self.shard_writer.pending is not None:
            began = time.perf_counter()
            self.shard_writer.wait()
            self.checkpoint_blocked_s += time.perf_counter() - began

    def _write_checkpoint(self) -> Optional[str]:
        """Every rank: this step's checkpoint; the path rank 0 wrote (None on the others)."""
        # The loss of this step was finite, but its update may not be: never save such weights.
        self.ctx.progress.at(self.step, "checkpointing")
        if not all(torch.isfinite(p).all() for p in self.runtime.module.parameters()):
            self._diverged(float("nan"), self.step)
        shards = self.shard_writer is not None
        state = self.runtime.shard_state_dict() if shards else self.runtime.state_dict()
        position = self._position()
        rng = [torch.get_rng_state()]
        if self.ctx.distributed and self.plan.layout.lockstep:
            gathered: list = [None] * self.ctx.world_size
            dist.all_gather_object(gathered, rng[0])
            rng = gathered
        path = str(ckpt.checkpoint_path(self.cfg.checkpoint_dir, self.step, sharded=shards))
        self.last_checkpoint, self.saved_step = path, self.step
        if state is None:  # (a rank whose part rank 0 gathered, e.g. a pipeline's later stage: nothing to write)
            return None
        small = {"format": ckpt.FORMAT, "step": self.step, "run_id": self.plan.run_id, **self._scheduler_state(),
                 "rng": rng, "meta": self._meta(state),
                 "data_position": {"epoch": position.epoch, "examples_in_epoch": position.offset}}
        if shards:  # every rank writes its own shards; rank 0 adds the small state and seals the directory
            self.shard_writer.save(state, small, self.cfg.checkpoint_dir, self.step, self.cfg.keep_checkpoints)
        elif self.ctx.is_main:
            ckpt.save_checkpoint({**small, **state}, self.cfg.checkpoint_dir, self.step, self.cfg.keep_checkpoints)
        return path if self.ctx.is_main else None

    def _scheduler_state(self) -> dict[str, Any]:
        """phalanx's own schedule under ``scheduler`` (as before); the user's under ``lr_scheduler``, which a
        resume loads (phalanx's is recomputed from the step)."""
        if self.scheduler is None:
            return {}
        key = "lr_scheduler" if self.plan.task.make_scheduler is not None else "scheduler"
        if self.stepped_scheduler is None:  # a constant schedule, never stepped: its count as if it had been
            self.scheduler.last_epoch = self.step
        return {key: self.scheduler.state_dict()}

    def _meta(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"world_size": self.ctx.world_size, "workers": self.plan.workers, "batch_size": self.cfg.batch_size,
                "accumulate": self.cfg.accumulate, "global_batch": self.global_batch,
                "model": self.plan.task.model_name, "data": self.plan.task.data_name,
                "training_step": self.cfg.training_step, "target_key": self.cfg.target_key,
                "model_class": self.model_class,
                "parameter_shapes": self._shapes(state),
                "strategy": self.cfg.strategy.name,
                "seed": self.cfg.seed, "input_shape": list(self.data.input_shape),
                "num_classes": self.data.num_classes, "settings": settings_of(self.cfg)}

    def _shapes(self, state: dict[str, Any]) -> dict[str, list[int]]:
        """Every tensor of the model, by name, and its shape: rank 0 records them all, also where each rank saves
        a part of the model only (a pipeline's stage: one small all-gather of the names and shapes), and a tied
        weight's every name (a pipeline's sharded checkpoint saves it once: ``shard_read.ALIASES``)."""
        shapes = {name: list(t.shape) for name, t in state["model"].items()}
        shapes.update({alias: shapes[key] for alias, key in state.get(ALIASES, {}).items() if key in shapes})
        if self.shard_writer is None or not self.ctx.distributed:
            return shapes
        parts: list = [None] * self.ctx.world_size
        dist.all_gather_object(parts, shapes)
        return {name: shape for part in parts for name, shape in part.items()}

    def _position(self) -> Position:
        """Where the data stands now: the examples consumed since the start position, in global batches."""
        return advance(self.start_position, self.step - self.start_step, len(self.data.train), self.global_batch)

    def _restore(self, state: dict[str, Any]) -> None:
        """Parameters, optimizer state (unless the optimizer changed), step, data position and RNG of a
        checkpoint written by any strategy on any worker count; the hyperparameters stay this run's."""
        for group in self.runtime.optimizer.param_groups:  # as a scheduled optimizer's, like the saved ones
            group.setdefault("initial_lr", group["lr"])  # (fsdp's loader wants the same keys in both)
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.runtime.optimizer.param_groups]
        if self.resumed.fresh_optimizer:
            state = ckpt.without_optimizer(state)
        if not self.runtime.writes_shards:  # a sharded checkpoint, read whole into this runtime's whole model
            state = ckpt.tensors(state)
        self.runtime.load_state_dict(state)
        restore_settings(self.runtime.optimizer, settings)
        self.step = self.start_step = int(state["step"])
        self.start_position = data_position(state, len(self.data.train))
        rng = state.get("rng") or []
        if self.ctx.rank < len(rng):
            torch.set_rng_state(rng[self.ctx.rank])
        self.last_checkpoint, self.saved_step = state["path"], self.step

    # ---- what rank 0 prints ----
    def _header(self) -> None:
        devs = sorted({str(d) for d in self.plan.layout.devices})
        backend = self.ctx.backend or "none (one process)"
        resumed = f", resuming at step {self.step}" if self.step else ""
        model = self.plan.task.model_name
        self.reporter.say(
            f"phalanx train: strategy {self.runtime.description}, world size {self.ctx.world_size}, devices "
            f"{', '.join(devs)}, backend {backend}, global batch {self.global_batch} "
            f"({self._batch_split()}), {model} on {self.data.name}{resumed}{self._threads()}"
        )
        resumed = self.resumed.lines if self.resumed else [self.init_line] if self.init_line else []
        for line in resumed + list(self.data.notes) + self.runtime.notes + self.straggle.lines() + self._precision_lines():
            self.reporter.say(line)
        self.reporter.say(settings_line(self.cfg) if self.resumed else self.plan.recipe)
        if self.straggle.fields():
            self.reporter.record("straggle", **self.straggle.fields())

    def _threads(self) -> str:
        """Each CPU worker's share of its machine's cores (a worker that took them all would fight the others)."""
        if self.ctx.device.type != "cpu":
            return ""
        n = torch.get_num_threads()
        return f", {n} thread{'s' if n > 1 else ''} per worker"

    def _precision_lines(self) -> list[str]:
        lines = []
        if self.cfg.precision != "fp32":
            scaler = ", with a gradient scaler" if self.cfg.precision == "fp16" else ""
            lines.append(f"precision: {self.cfg.precision} autocast in every forward pass{scaler}; parameters, "
                         "gradients, optimizer state and checkpoints in fp32")
        if self.recomputed is not None:
            lines.append(self.recomputed.line())
        if self.compiled:
            lines.append(f"compiled: {self.compiled} blocks, each with torch.compile (the first steps include "
                         "the compilation)")
        return lines

    def _batch_split(self) -> str:
        shards = self.plan.layout.shards
        readers = sum(rank.shard is not None for rank in self.plan.layout.ranks)
        if shards == self.ctx.world_size:
            return f"{self.cfg.batch_size} per worker x {self.ctx.world_size}"
        if shards == 1:
            return "every worker reads the whole batch"
        if readers == shards:  # one rank reads no data (a parameter server)
            return f"{self.cfg.batch_size} per worker x {shards} workers"
        return f"{self.cfg.batch_size} per replica x {shards} replicas, each read by {readers // shards} ranks"

    def _summary(self, values: Optional[dict[str, float]], steps: int, seconds: float, reached: bool,
                 stopped: Optional[str] = None) -> dict[str, Any]:
        rate = steps * self.global_batch / max(seconds, 1e-9)
        report = self.runtime.report(final=True)
        mine, most, wire = self._gathered()
        summary = {"steps": self.step, "test_accuracy": (values or {}).get("accuracy"), "test_metrics": values,
                   "held_out": self.data.held_out, "examples_per_sec": rate,
                   "train_seconds": seconds, "eval_seconds": self.eval_seconds,
                   "checkpoint_blocked_s": round(self.checkpoint_blocked_s, 6),
                   "target": None if self.target is None else str(self.target),
                   "stopped_at_target": reached, "stopped_at_accuracy": reached, "checkpoint": self.last_checkpoint,
                   "metrics": self.cfg.metrics, "stopped_by": stopped,
                   "world_size": self.ctx.world_size, "strategy": self.cfg.strategy.name,
                   "precision": self.cfg.precision, "compiled_blocks": self.compiled,
                   **({"activation_checkpointing": self.recomputed.fields()} if self.recomputed else {}),
                   "watch_cpu_seconds": round(self.ctx.progress.cpu_seconds, 4),
                   "memory_bytes": mine.as_dict(), **({"memory_bytes_max": most.as_dict()} if most else {}),
                   "startup_seconds": self.marks.seconds, **summary_fields(self.meter, wire, steps, self.link_at),
                   **report.fields}
        self.reporter.record("summary", **summary)
        self.reporter.close()
        if stopped:
            self.reporter.result(f"stopped at step {self.step} by {stopped}")
        else:
            if reached:
                self.reporter.result(f"stopped at step {self.step}: {self.data.held_out} {self.target.metric} "
                                     f"reached the target {self.target}")
            self.reporter.result(f"{self.data.held_out} {said(values)} after {self.step} steps")
        self.reporter.result(f"throughput {rate:.1f} examples/sec (global), training time {seconds:.1f} s")
        for line in describe(mine, most):
            self.reporter.result(line)
        self.reporter.result(summary_line(self.meter, wire, steps))
        for line in report.lines:
            self.reporter.result(line)
        if self.cfg.profile_startup:
            self.reporter.result(self.marks.line())
        self.reporter.result(f"checkpoint {self.last_checkpoint}")
        self.reporter.result(f"metrics {self.cfg.metrics}")
        return summary

    def _gathered(self) -> tuple[Held, Optional[Held], Optional[float]]:
        """This rank's parameter, gradient and optimizer bytes; the max over ranks; and the job's bytes
        on the wire in the steps (what every rank sent), or None where unknown here.

        Ranks in step gather both in one collective, once, after the last step. A job whose every
        message has rank 0 at one end (a parameter server) needs none: rank 0's sent and received
        bytes are everything that crossed. Other ranks not in step cannot gather: None."""
        mine = held(self.runtime.module, self.runtime.optimizer)
        layout = self.plan.layout
        if not self.ctx.distributed:
            return mine, None, 0.0
        if not layout.lockstep:
            return mine, None, self.meter.total if layout.hub == self.ctx.rank else None
        every: list = [None] * self.ctx.world_size
        dist.all_gather_object(every, (mine, self.meter.sent))
        return mine, largest([m for m, _ in every]), sum(sent for _, sent in every)

    def close(self) -> None:
        if self.shard_writer is not None:
            self.shard_writer.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.runtime.close()
        self.reporter.close()

