"""A pipeline's runtime: one stage per worker, micro-batches through ``torch.distributed.pipelining``.

Who talks to whom (see the package's docstring for the whole picture): a stage receives activations
from the stage before it and gradients from the stage after it (point-to-point, in its replica's
pipeline group); after the schedule it averages gradients and floating-point buffers over its
replicas (one flat all-reduce per dtype); the loss, the gradient norm and the evaluation's counts
are summed over the ranks. Where the model is cut is ``planner.py``'s; checkpoints are
``checkpoint.py``'s; a model split by tracing runs through ``traced.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...data import batch as tree
from ...errors import PhalanxError
from ...task.metrics import Totals
from ..balance import bounds
from ..base import COUNT_CORRECT, Batch, Build, Report, as_batch
from .checkpoint import StageCheckpoints
from .mesh import check_mesh
from .planner import StagePlanner
from .split import StageModule, model_blocks
from .traced import TracedStage, stage_optimizer

if TYPE_CHECKING:
    from . import Pipeline


def _schedule_class(name: str):
    from torch.distributed.pipelining import Schedule1F1B

    from .schedule import GPipeAhead

    return {"gpipe": GPipeAhead, "1f1b": Schedule1F1B}[name]


class PipelineRuntime(StageCheckpoints):
    """One stage of the pipeline (or, on one rank, the whole model micro-batched in-process)."""

    def __init__(self, build: Build, options: Pipeline):
        ctx, model = build.ctx, build.model
        self.build, self.ctx, self.options = build, ctx, options
        self.stages = options.stages or ctx.world_size
        self.replicas = check_mesh(self.stages, ctx.world_size)
        #: this rank's place on the mesh (rank = stage x replicas + replica)
        self.stage_index, self.replica = divmod(ctx.rank, self.replicas)
        #: this replica's pipeline (point-to-point) and this stage's replicas (gradient all-reduce);
        #: None: the default group (one pipeline) or no group at all
        self.pipe_group, self.replica_group = self._mesh_groups()
        #: False: one stage, the whole model micro-batched in-process, no engine
        self.pipelined = self.stages > 1
        self._schedules: dict[Any, Any] = {}
        #: the stages before this one, as they run on their ranks: what sizes this stage's input
        self._upstream: list[StageModule] = []
        #: the model split by tracing (None: cut at its blocks)
        self.traced: Optional[TracedStage] = None
        optimizer = None
        planner = StagePlanner(options, build, self.stages, self.replicas, self.replica, self.stage_index,
                               self.pipe_group)
        if options.traces(model, build):
            self.plan, points = planner.traced(model)
            if self.pipelined:
                self.traced = self._traced_stage(model, build, points)
                # The user's factory sees the user's model (its own groups), then keeps this stage's parameters.
                optimizer = stage_optimizer(build.make_optimizer(model), self.traced.module)
            stage = self.traced.module if self.traced is not None else model
        else:
            named = model_blocks(model)
            self.plan = planner.blocks(named)
            stage = model
            if self.pipelined:
                spans = bounds(self.plan.counts)
                self._upstream = [self._stage_module(named[lo:hi], build) for lo, hi in spans[:self.stage_index]]
                stage = self._stage_module(named[slice(*spans[self.stage_index])], build)
        self.stage_module = stage
        super().__init__(build, stage, optimizer=optimizer, description=options.describe(self.stages, self.replicas),
                         notes=self.plan.lines() + self._tied_lines())
        index = {id(p): i for i, p in enumerate(model.parameters())}
        #: the whole model's parameter index of each parameter of this stage's optimizer, in its order
        self.local_to_global = [index[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        self._groups: Optional[list[list[str]]] = None  #: see _whole_groups

    def _traced_stage(self, model: nn.Module, build: Build, points: tuple[str, ...]) -> TracedStage:
        if build.example is None:
            raise PhalanxError("a pipeline split by tracing needs an example batch to trace the step on: give "
                               "example=... (phalanx train passes one)")
        micro = self.options.chunks * build.accumulate
        example = tree.to_device(build.example, self.ctx.device)
        return TracedStage(model, build.step, points, self.stages, self.stage_index, self.replicas, self.replica,
                           self.ctx.device, self.pipe_group, build.precision.around_forward,
                           tree.split(example, micro)[0])

    def _tied_lines(self) -> list[str]:
        if self.traced is None or not self.traced.tied:
            return []
        names = {i: n for i, (n, _) in enumerate(self.build.model.named_parameters())}
        shown = "; ".join(f"{names[i]} on stages {', '.join(map(str, s))}" for i, s in self.traced.tied.items())
        return [f"  tied across stages (each keeps a copy, their gradients summed before the step): {shown}"]

    @staticmethod
    def _stage_module(named: list[tuple[str, nn.Module]], build: Build) -> StageModule:
        module = StageModule(named)
        build.precision.around_forward(module)  # the engine calls the stage itself, forward and backward interleaved
        return module

    def _new_stage(self, module: nn.Module, micro_batch: torch.Tensor, backward: bool):
        """torch's ``PipelineStage`` for ``module`` in its static mode, sized for ``micro_batch``'s shape:
        no shape inference, so no extra pass through the stage (see ``pipeline/stage.py``)."""
        from .stage import static_stage

        return static_stage(self._upstream + [module], self.stage_index, self.stages, self.ctx.device,
                            self.pipe_group, micro_batch, backward)

    def _mesh_groups(self) -> tuple[Any, Any]:
        """Process groups of the 2-D mesh (stages x replicas); (None, None) for one pipeline."""
        if self.replicas == 1:
            return None, None
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.ctx.device.type, (self.stages, self.replicas),
                                     mesh_dim_names=("stage", "replica"))
        return self.mesh.get_group("stage"), self.mesh.get_group("replica")

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.stages - 1

    # ---- a training step ----
    def train_step(self, batch: Any, y: Optional[torch.Tensor] = None, parts: Optional[int] = None) -> torch.Tensor:
        batch = as_batch(batch, y)
        micro = self.options.chunks * self.build.accumulate
        if tree.length(batch) % micro:
            raise PhalanxError(f"batch {tree.length(batch)} does not split into {micro} equal micro-batches")
        if not self.pipelined:  # one stage: the whole model, micro-batched in-process as the engine would
            loss = self.forward_backward(batch, parts=micro)
            self._average_over_replicas()
            self.update()
            return loss
        losses: list[torch.Tensor] = []
        if self.traced is not None:
            self.traced.train(_schedule_class(self.options.schedule), batch, micro, losses)
        else:
            self._cut_step(batch, micro, losses)
        self._average_over_replicas()
        if self.traced is not None:
            self.traced.sum_tied()
        self.update()
        if self.is_last:
            return torch.stack([loss.detach() for loss in losses]).mean()
        return torch.zeros((), device=self.ctx.device)  # only the last stage knows it: see global_losses

    def _cut_step(self, batch: Any, micro: int, losses: list) -> None:
        if not tree.is_pair(batch):
            raise PhalanxError("a pipeline cut at the model's blocks takes batches (inputs, targets): its schedule "
                               "feeds the first stage the inputs and the last the targets; give --split-points to "
                               "trace the model's step instead")
        x, y = batch
        schedule = self._training_schedule(x, micro)
        if self.is_first:
            schedule.step(x, return_outputs=False)
        elif self.is_last:
            schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)

    def clip_gradients(self) -> None:
        """As the base class's, with each tied parameter's gradient counted once in the norm (on the first
        stage holding it); every copy is scaled alike, so the copies stay equal."""
        if self.traced is None:
            return super().clip_gradients()
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        owned = self.traced.owned()
        self.grad_norm = self.gradient_norm([p.grad for p in params if id(p) in owned])
        assert self.build.clip_grad_norm is not None, "called where the run clips (--clip-grad-norm)"
        torch.nn.utils.clip_grads_with_norm_(params, self.build.clip_grad_norm, self.grad_norm)

    def gradient_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The whole model's gradient norm: every stage holds a part of it (a tied weight counted on one stage
        only: :meth:`clip_gradients`), so the squared norms add up over this replica's pipeline (one small all-reduce;
        the replicas of a stage hold the same averaged gradient, so every rank gets the same norm)."""
        mine = super().gradient_norm(grads).to(self.ctx.device)
        if not self.pipelined:
            return mine
        squared = mine.square()
        dist.all_reduce(squared, group=self.pipe_group)
        return squared.sqrt()

    @torch.no_grad()
    def _average_over_replicas(self) -> None:
        """Average this stage's gradients, and its floating-point buffers, over its replicas: one flat
        all-reduce per dtype.

        Why the buffers: each replica's BatchNorm takes only its own shard's micro-batches into its
        running statistics, so without this the replicas of one stage would drift into different
        models (the checkpoint holds replica 0's; each replica evaluates with its own). Averaged
        after every step, they stay one model, as DDP keeps its replicas' buffers equal (it
        broadcasts rank 0's). Integer buffers (``num_batches_tracked``) move alike on every replica:
        each runs the same number of micro-batches.

        Why not DDP around the stage, which the engine knows how to drive: in torch 2.13 DDP's
        bucket rebuild fails on a pipeline's second step ("rebuilt parameter indices size is not
        same as original model parameters size"), and with ``static_graph`` the replicas' gradients
        came out different. One all-reduce after the schedule costs the overlap with the last
        backward, and is exact.
        """
        if self.replica_group is None:
            return
        params = [p for p in self.stage_module.parameters() if p.requires_grad]
        shared = []
        for p in params:
            if p.grad is None:  # every replica must send the same layout
                p.grad = torch.zeros_like(p)
            shared.append(p.grad)
        shared += [b for b in self.stage_module.buffers() if b.is_floating_point()]
        for dtype in sorted({t.dtype for t in shared}, key=str):
            tensors = [t for t in shared if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.all_reduce(flat, group=self.replica_group)
            flat /= self.replicas
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(part.view_as(t))

    def _training_schedule(self, x: torch.Tensor, micro: int):
        """The schedule for ``micro`` micro-batches of this batch's shape: a stage's buffers are sized
        for one shape, so a batch of another shape (a caller's own loop may feed one) gets its own."""
        key = ("train", micro, tuple(x.shape), x.dtype)
        if key not in self._schedules:
            stage = self._new_stage(self.model, x[: len(x) // micro], backward=True)
            # scale_grads: the engine divides the summed micro-batch gradients by M, which with a
            # mean loss per micro-batch is the gradient of the mean over the whole batch.
            self._schedules[key] = _schedule_class(self.options.schedule)(
                stage, micro, loss_fn=self.build.loss_fn, scale_grads=True)
        return self._schedules[key]

    def global_losses(self, losses: torch.Tensor) -> torch.Tensor:
        """The mean of the last stages' losses over the replicas, on every rank (the other stages add 0)."""
        if not self.pipelined:
            return super().global_losses(losses)
        out = losses.detach().to(self.ctx.device, torch.float32).clone()
        dist.all_reduce(out)
        return out / self.replicas

    # ---- evaluation ----
    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch], totals: Totals = COUNT_CORRECT) -> tuple[float, ...]:
        """The sums and counts of ``totals`` over every replica's part of the test set.

        Every stage of one replica must be given the same batches; replicas evaluate their parts
        independently (no collective between them until the sums are added).
        """
        if not self.pipelined:
            return super().evaluate(batches, totals)
        was_training = self.model.training
        self.model.eval()
        sums = totals.zeros()
        for batch in batches:
            batch = tree.to_device(batch, self.ctx.device)
            sums += self._cut_eval(batch, totals) if self.traced is None else \
                self.traced.evaluate(_schedule_class("gpipe"), batch, self.options.chunks, totals)
        self.model.train(was_training)
        sums = sums.to(self.ctx.device)
        dist.all_reduce(sums)  # the last stage of every replica added its part; the others hold zeros
        return tuple(sums.tolist())

    def _cut_eval(self, batch: Any, totals: Totals) -> torch.Tensor:
        x, y = batch
        schedule = self._eval_schedule(x)
        if self.is_first:
            schedule.eval(x)
        elif self.is_last:
            return totals(schedule.eval(), y)
        else:
            schedule.eval()
        return totals.zeros()

    def _eval_schedule(self, x: torch.Tensor):
        """A forward-only schedule for batches of this shape (a stage's buffers are sized for one shape:
        the test set's last, smaller batch gets its own), in micro-batches of equal size."""
        key = ("eval", tuple(x.shape), x.dtype)
        if key not in self._schedules:
            from torch.distributed.pipelining import ScheduleGPipe

            micro = max(m for m in range(1, min(self.options.chunks, len(x)) + 1) if len(x) % m == 0)
            # The bare stage: evaluation needs no gradient reduction, so it never waits for other replicas.
            stage = self._new_stage(self.stage_module, x[: len(x) // micro], backward=False)
            self._schedules[key] = ScheduleGPipe(stage, micro, loss_fn=None, scale_grads=False)
        return self._schedules[key]

    # ---- checkpoints: StageCheckpoints (checkpoint.py) ----
    def report(self, final: bool = False) -> Report:
        fields = {"stages": self.plan.stages, "replicas": self.replicas, "chunks": self.options.chunks,
                  "schedule": self.options.schedule, "balance": list(self.plan.counts),
                  "predicted_bubble": round(self.plan.bubble(), 4)}
        step = self.plan.step_seconds()
        if step is not None:  # the schedule alone: forwards, backwards and messages, from the measured times
            fields["predicted_step_seconds"] = round(step, 6)
        return Report(fields)

    def close(self) -> None:
        self._schedules.clear()
        if self.traced is not None:
            self.traced.schedules.clear()

