"""Inside a worker: the training loop. It knows nothing about parallelism.

:func:`run_worker` builds this rank's run (:class:`WorkerRun`: the data, the model, the strategy's runtime
around it, a checkpoint restored) and trains it. :meth:`WorkerRun.train` reads top to bottom: the header,
the global steps (each: the stop agreement, one step of the runtime, the learning rate; then a log, an
evaluation and a checkpoint where due), what the strategy still owes the model, the last evaluation and
checkpoint, the summary. The runtime is the only thing that knows the strategy; the loop calls its few
methods (see ``strategies/base.py``) the same way for all. Around the loop, each a class of its own: the
stop agreement (``stop.py``), this rank's data (``feed.py``), the learning rate (``learning_rate.py``),
checkpoints (``saving.py``), the header and the summary (``summary.py``). A peer lost in a collective (a
worker killed) ends the run, after the survivors saved the step they finished
(:meth:`WorkerRun._save_survivors`).
"""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import nn

from ..data import eval_batches, load_data
from ..errors import TrainingDiverged
from ..launcher import WorkerContext
from ..launcher.joined import lost_peer
from ..launcher.survivors import survivors
from ..task.metrics import Totals, said
from ..comm.wire import Meter, metering
from ..task import is_import_path, resolve
from ..data.batch import split, to_device
from ..precision import Precision, compile_model
from ..recompute import Recomputed, checkpoint_blocks
from ..launcher.startup import Marks
from ..strategies import Build, meta_init
from .. import checkpoint as ckpt
from .feed import Feed
from .learning_rate import LearningRate
from .losses import LossWindow
from .plan import Plan
from .step_errors import explained
from .report import Reporter, step_line
from .resume import check_fits, resume_config
from .saving import Checkpointer, restore, run_meta
from .stop import StopAgreement
from ..scenarios.straggle import Straggle

if TYPE_CHECKING:
    from .config import TrainConfig
from .summary import Outcome, Summary


def run_worker(ctx: WorkerContext, plan: Plan) -> dict[str, Any]:
    with metering() as meter:  # every collective and message of this process, priced (wire.py)
        run = WorkerRun(ctx, plan, meter)  # the data, the model in the strategy's runtime, a checkpoint restored
        try:
            return run.train()  # the steps, the last evaluation and checkpoint: rank 0's summary
        finally:
            run.close()


class WorkerRun:
    """One rank's share of the run, built in the order a worker needs it: the checkpoint's settings, the
    data, the plain model, the straggler's calibration, the strategy's runtime, the checkpoint's state, the
    learning rate, and what watches the steps; then :meth:`train`."""

    def __init__(self, ctx: WorkerContext, plan: Plan, meter: Optional[Meter] = None):
        self.ctx, self.plan, self.role = ctx, plan, plan.layout.ranks[ctx.rank]
        self.marks = Marks(plan.began, plan=plan.planned)  # where the start-up's seconds go
        self.marks.mark("joined")
        self.meter = meter or Meter()  #: this rank's bytes on the wire in the training steps
        # A checkpoint's settings fill in what no flag gave, before anything is built from the config.
        # (verify=False: the plan verified every shard of a sharded checkpoint; a file is verified as it loads)
        state = ckpt.load_checkpoint(plan.resume_path, verify=False) if plan.resume_path else None
        self.resumed = resume_config(plan.config, state, plan.layout.shards) if state else None
        cfg = self.cfg = self.resumed.config if self.resumed else plan.config
        self.steps = cfg.total_steps  # the run's last step (read every step)
        self.data = plan.data or self._load_data(cfg)
        self.marks.mark("data")
        self.global_batch = cfg.batch_size * plan.layout.shards
        self.feed = Feed(self.data, cfg.batch_size, self.role, plan.layout, cfg.seed, self.global_batch)
        example = self.feed.example()
        model = self._model(state, example)
        self.marks.mark("model")
        # Before the runtime: calibrating shares every rank's compute time (a collective).
        self.straggle = Straggle.start(cfg.slowness, ctx, self.role.shard, model, example, plan.task.step,
                                       cfg.accumulate, cfg.seed)
        self.marks.mark("calibration")
        self.runtime = cfg.options.runtime(self._build(model, example))
        self.marks.mark("strategy")
        self.step = self._restore(state)
        self.lr = LearningRate(self.runtime, plan.task, cfg, self.step, state)
        self.straggle.begin(self.step)
        self._start_watching(state)

    # ---- building: the model, then the strategy's runtime around it ----
    @staticmethod
    def _load_data(cfg: TrainConfig) -> Any:
        """A built-in data set by name (a user's arrives in the plan)."""
        assert cfg.synthetic_shape is not None and cfg.synthetic_size is not None, "resolved() fills their defaults"
        return load_data(cfg.data, cfg.data_dir, tuple(cfg.synthetic_shape), cfg.synthetic_size, cfg.seed)

    def _model(self, state: Optional[dict[str, Any]], example: Any) -> nn.Module:
        """The plain model on this rank's device, equal on every rank: the user's, with --init-from's weights,
        --activation-checkpointing and --compile applied in place, before any strategy wraps it (torchtitan's
        order)."""
        cfg = self.cfg
        model = self._build_model()
        if not meta_init.on_meta(model):  # (on meta: the strategy's runtime materialises its shards)
            model = model.to(self.ctx.device)
        self.model_class = f"{type(model).__module__}.{type(model).__qualname__}"  # recorded in checkpoints
        if state:  # before any strategy wraps it: the plain model's names are the checkpoint's
            check_fits(state, model, state["path"])
        self.init_line = self._init_from(model) if cfg.init_from and not state else None
        self.recomputed = self._checkpoint_activations(model, example) if cfg.activation_checkpointing else None
        # (recomputed blocks are compiled one by one, as torchtitan does: each holds its own checkpoint)
        whole = cfg.options.compiles_whole(self.ctx.world_size) and self.recomputed is None
        self.compiled = compile_model(model, whole) if cfg.compile else None
        return model

    def _build_model(self) -> nn.Module:
        torch.manual_seed(self.cfg.seed)  # the same initial weights on every worker
        with meta_init.building(self.cfg.options.builds_on_meta()):
            return self.plan.task.make_model(self.data.input_shape, self.data.num_classes)

    def _init_from(self, model: nn.Module) -> str:
        """Fine-tuning (--init-from): the checkpoint's weights, loaded into the plain model on every rank (so the
        replicas start equal) before a strategy wraps it; its optimizer, step and data position are not taken."""
        # (the plan verified it and checked that it fits; a sharded checkpoint's shards are read whole here)
        assert self.cfg.init_from is not None, "called for --init-from only"
        state = ckpt.tensors(ckpt.load_checkpoint(self.cfg.init_from, "--init-from", verify=False), optimizer=False)
        model.load_state_dict(state["model"])
        return (f"starting from the weights of {state['path']} (step {state['step']}), with a fresh optimizer and "
                "schedule from step 0")

    def _checkpoint_activations(self, model: nn.Module, example: Any) -> Recomputed:
        """--activation-checkpointing on the strategy's blocks; rank 0 measures what it saves on its first
        micro-batch (two forwards, nothing changed: see recompute.py)."""
        units = self.cfg.options.units(model)
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

    def _build(self, model: nn.Module, example: Any) -> Build:
        """What the strategy's runtime is built from."""
        cfg, task = self.cfg, self.plan.task
        return Build(self.ctx, self.plan.layout, model, self._make_optimizer, task.loss_fn, cfg.total_steps,
                     cfg.accumulate, example, cfg.hang_timeout_s, Precision(cfg.precision, self.ctx.device.type),
                     cfg.clip_grad_norm, task.step)

    def _make_optimizer(self, module: nn.Module) -> torch.optim.Optimizer:
        task = self.plan.task
        if task.make_optimizer is None and is_import_path(self.cfg.optimizer):  # a checkpoint's, on --resume
            task.make_optimizer = resolve(self.cfg.optimizer, "--optimizer", "params -> torch.optim.Optimizer")
        return task.optimizer_for(self.cfg, module, self.global_batch)

    def _restore(self, state: Optional[dict[str, Any]]) -> int:
        """The step the run starts at: a checkpoint's (its state loaded into the runtime, the data moved on to
        its position), or 0."""
        if not state:
            return 0
        assert self.resumed is not None, "a checkpoint's state is a resumed run's"
        step, position = restore(self.runtime, state, self.resumed.fresh_optimizer, self.ctx.rank,
                                 len(self.data.train))
        self.feed.resume(step, position)
        return step

    def _start_watching(self, state: Optional[dict[str, Any]]) -> None:
        """What watches the steps: evaluation, the target, what rank 0 reports, checkpoints, the stop agreement."""
        ctx, plan, cfg = self.ctx, self.plan, self.cfg
        self.eval_seconds = 0.0  # evaluation time, kept out of the training time
        # What evaluation adds up: every metric's (sum, count), over every rank (exact, see metrics.py).
        self.totals = Totals(plan.task.metrics, plan.task.loss_fn)
        self.target = cfg.target  # what stops the run early (None: nothing)
        self.told_targetless = False  # a step whose batch had no target was said (once)
        self.reporter = Reporter(ctx.is_main, cfg.progress, cfg.metrics, cfg.total_steps, self.step,
                                 resumed_from=plan.resume_path, run_id=plan.run_id, tensorboard=cfg.tensorboard)
        meta = run_meta(ctx, plan, cfg, self.data, self.global_batch, self.model_class)
        self.saver = Checkpointer(ctx, self.runtime, plan.layout, cfg, self.meter, plan.run_id, meta,
                                  resumed=(state["path"], self.step) if state else None)
        self.summary = Summary(ctx, plan, cfg, self.runtime, self.data, self.reporter, self.meter, self.marks,
                               self.global_batch, self.recomputed, self.compiled)
        self.stop = StopAgreement(ctx, plan.layout.stop_rule, plan.layout.drift)

    # ---- the loop ----
    def train(self) -> dict[str, Any]:
        self.summary.header(self.step, self.resumed, self.init_line, self.straggle)
        inputs = self.feed.inputs(self.step, self.ctx.device, self.cfg.prefetch)
        self.began, first_step = time.perf_counter(), self.step
        self.ctx.progress.handle_signals()  # from here on SIGTERM/SIGINT mean: stop at a step boundary and save
        try:
            hit = self._steps(inputs)
            return self._finish(hit, first_step)
        except RuntimeError as e:  # (torch's DistError is one)
            if lost_peer(e) is not None:
                self._save_survivors()  # the survivors save what they hold; the lost peer stays the error
            raise

    def _steps(self, inputs: Iterator) -> Optional[dict[str, float]]:
        """Global steps until the last one, a stop the ranks agreed on, an asynchronous worker told to stop, or
        an evaluation that reaches the target (returned; None where none did)."""
        # An ordinary step reads nothing on the host and runs no collective of its own: the losses
        # wait on the device until a log or checkpoint step looks at them (see losses.py).
        window = LossWindow(self.ctx.device, self.cfg.log_every)
        self.logged = (self.began, self.step)  # when and at which step the last progress line was
        self.stop.begin(self.step)
        self.summary.count_wire(True)
        hit = None
        while self.step < self.steps and hit is None and not self.stop.reached(self.step):
            taken = self._step(inputs)
            if taken is None:  # an asynchronous worker told to stop
                break
            self.step, loss = taken
            window.add(self.step, loss)
            hit = self._after_step(window)
        if len(window):  # every rank stops at the same step, holding the same steps
            self._check_losses(window)
        return hit

    def _step(self, inputs: Iterator) -> Optional[tuple[int, Any]]:
        """One global step of the runtime: the step it reached and its loss (on the device), or None where an
        asynchronous worker was told to stop."""
        self.ctx.progress.at(self.step + 1, "the training step")
        batch = next(inputs)
        self.lr.before_step()
        try:
            loss = self.runtime.train_step(batch)
        except RuntimeError as e:  # (free in the hot path: a try costs nothing until it catches)
            known = explained(e, self.runtime.module)
            if known is None:
                raise
            raise known from None
        self.marks.mark("first_step")  # (the first call counts; on a GPU: when the step was queued)
        if self.straggle.active:
            self.straggle.after_step()
        self.lr.advance()
        following = self.runtime.next_step(self.step)
        return None if following is None else (following, loss)

    def _after_step(self, window: LossWindow) -> Optional[dict[str, float]]:
        """A log, an evaluation and a checkpoint, where this step is due one; the evaluation if it reached the
        target."""
        self.reporter.advance()
        logging = self.step % self.cfg.log_every == 0 or self.step == self.cfg.steps
        saving = bool(self.cfg.checkpoint_every) and self.step % self.cfg.checkpoint_every == 0
        if logging or saving or window.full:
            value = self._check_losses(window)
        if logging:
            self._log(value)
        hit = None
        if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 and self.step < self.steps:
            values = self._evaluate()
            hit = values if self.target is not None and self.target.reached(values) else None
        if saving:
            self._save()
        return hit

    def _finish(self, hit: Optional[dict[str, float]], first_step: int) -> dict[str, Any]:
        """After the last step: the model's last evaluation and checkpoint (unless a stop asked for speed), then
        the summary."""
        self.ctx.progress.at(self.step, "finishing")
        # What the strategy still owes the model goes in now (a last averaging, an outer round, the
        # gradients in flight): what is printed, saved and evaluated afterwards is that one model. A stop
        # (a signal) is no end: what only the end owes stays owed, and the checkpoint holds the state at
        # the step where the run stopped, which a resume continues exactly.
        stopped = self.stop.stopped_by(self.step)
        changed = self.runtime.finish(stopping=bool(stopped))
        self.summary.count_wire(False)
        elapsed = time.perf_counter() - self.began - self.eval_seconds
        values = hit
        # The last checkpoint first, written out before the last evaluation: an evaluation that fails (a
        # model's own error at the end, a worker lost) must not lose the run's work. (The evaluation changes
        # no weight: what it prints is this checkpoint's.)
        if changed or self.saver.saved_step != self.step:
            self._save()
        self.saver.wait_for_save()  # (the run's last checkpoint is written before its summary names it)
        if stopped:  # a stop asked for speed: save, go
            values = None
        elif changed or hit is None:  # (a target reached by this step's evaluation of this model: not twice)
            values = self._evaluate(final=True)
        return self.summary.final(Outcome(self.step, self.step - first_step, elapsed, self.eval_seconds, values,
                                          hit is not None, stopped, self.saver.last, self.saver.blocked_s))

    def _check_losses(self, window: LossWindow) -> float:
        """The NaN guard over every step since the last look, on the losses every rank agrees on (so
        every rank stops at the same step); returns the newest agreed loss."""
        steps, losses = window.drain(self.runtime.global_losses)
        for step, loss in zip(steps, losses):
            if not math.isfinite(loss) and not self._nothing_to_learn(step, loss):
                self._diverged(loss, step)
        shown = next((v for v in reversed(losses) if math.isfinite(v)), losses[-1])
        self.reporter.show_loss(shown)
        return shown

    def _nothing_to_learn(self, step: int, loss: float) -> bool:
        """Whether a step's loss is NaN because a batch of it had no target (all ``-100``: a mean over nothing, whose
        gradient is zero), not because the model diverged; said once, recorded at every such step."""
        shard = self.feed.targetless(step)
        if shard is None:
            return False
        self.reporter.record("no_targets", step=step, loss=str(loss), shard=shard)
        if not self.told_targetless:
            self.told_targetless = True
            self.reporter.say(f"note: step {step}'s batch (data shard {shard}) has no target to learn from (every "
                              f"label -100), so its loss is {loss} and its gradient zero; such steps train nothing "
                              "and are left out of the losses shown")
        return True

    def _diverged(self, loss: float, step: int) -> None:
        if self.role.expendable:
            # A rank the job can lose (a parameter server's worker) holds the server's parameters and
            # writes no checkpoint: the server sees every loss and stops the job at the first bad one.
            return
        self.saver.wait_for_save()  # the checkpoint in flight, if any, is the last good one: written before named
        last = self.saver.last or "none (no checkpoint was written before this step)"
        inputs = self.runtime.nonfinite_inputs(step) or self.feed.nonfinite_inputs(step)
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

    def _log(self, loss: float) -> None:
        now = time.perf_counter()
        then, then_step = self.logged
        steps, seconds = self.step - then_step, now - then
        self.logged = (now, self.step)
        rate = steps * self.global_batch / max(seconds, 1e-9)
        per_batch = seconds / max(steps, 1)
        self.reporter.say(step_line(self.step, loss, rate, per_batch))
        norm = self.runtime.grad_norm  # (a host read of the device's norm: at log steps only)
        clipped = {"grad_norm": float(norm)} if norm is not None and self.ctx.is_main else {}
        self.reporter.record("step", step=self.step, loss=loss, lr=float(self.lr.used), **clipped,
                             examples_per_sec=rate, sec_per_batch=per_batch, **self.runtime.report().fields)

    def _evaluate(self, final: bool = False) -> dict[str, float]:
        """Every metric on the test set now, over every rank's part; its time is kept out of the training
        time (``train_seconds``: so far). The metrics file has them under ``metrics`` (and ``accuracy``
        where it is one, under its own key too)."""
        self.ctx.progress.at(self.step, "evaluation")
        self.runtime.arrive_for_evaluation()  # (on the training clock: the wait for a straggler is training's)
        began = time.perf_counter()
        part = self.role.evaluates
        batches = eval_batches(self.data.test, 256, *part) if part is not None else iter(())
        with self.meter.aside():  # not a training step's traffic
            values = self.totals.values(self.runtime.evaluate(batches, self.totals))
        seconds = time.perf_counter() - began
        accuracy = {"accuracy": values["accuracy"]} if "accuracy" in values else {}
        self.reporter.record("eval", step=self.step, **accuracy, metrics=values, held_out=self.data.held_out,
                             train_seconds=began - self.began - self.eval_seconds, eval_seconds=seconds,
                             **self.runtime.report().fields)
        self.eval_seconds += seconds
        if not final:  # the summary says the final one
            self.reporter.say(f"step {self.step}, {self.data.held_out} {said(values)}")
        return values

    # ---- checkpoints ----
    def _save(self) -> None:
        record = self.saver.save(self.step, self.lr.state(self.step), self.feed.position(self.step), self._diverged)
        if record is not None:
            self.reporter.record("checkpoint", **record)

    def _save_survivors(self) -> None:
        """A peer was lost: a collective with it failed here, and the job's group is broken. Where every rank
        holds the whole model, the survivors agree who they are through the store and the first of them saves
        what they hold at the step they finished, without that group (``launcher/survivors.py``), so a restart
        loses at most the step in flight. What goes wrong here is said in one line, and saves nothing."""
        if not self.cfg.options.survivors_save or not self.ctx.distributed:
            return
        phase = self.ctx.progress.phase  # (where the peer was lost, for whoever names it next)
        self.ctx.progress.at(self.step, "saving what the survivors hold")
        found = None
        try:
            found = survivors(self.ctx.store, self.ctx.rank, self.ctx.world_size, self.step, self.cfg.timeout_s)
            if found is None:
                return
            saved = self.runtime.survivor_state(self.step, found)
            if saved is None:
                return
            if saved.step > self.step:  # (its update went in before the collective failed: its rate moves on)
                self.lr.advance()
            fresh = saved.step > (self.saver.saved_step or 0)  # (not a step saved already, nor step 0)
            finite = all(torch.isfinite(t).all() for t in saved.state["model"].values() if t.is_floating_point())
            if self.ctx.rank != found.writer or not fresh or not finite:
                return
            who = {"ranks": list(found.ranks), "lost": list(found.lost)}
            path = self.saver.save_alone(saved.step, saved.state, found.rng(), self.lr.state(saved.step),
                                         self.feed.position(saved.step), survivors=who)
            lost = ", ".join(self.plan.layout.label(r) for r in found.lost) or "a peer"
            why = f" ({saved.note})" if saved.note else ""
            print(f"{lost} lost; {self.role.label} saved step {saved.step}, the last step the survivors finished"
                  f"{why}: {path}", flush=True)
            self.reporter.record("checkpoint", step=saved.step, path=path, survivors=who)
        except Exception as e:  # (the save's own errors: a full disk, a survivor lost too)
            print(f"{self.role.label}: the survivors could not save ({str(e).splitlines()[0][:160]})", file=sys.stderr,
                  flush=True)
        finally:
            self.ctx.progress.at(self.step, phase)
            if found is not None:
                found.done()  # (the launcher waits for every survivor's, then ends whoever is left)

    def close(self) -> None:
        self.saver.close()
        self.feed.close()
        self.runtime.close()
        self.reporter.close()
