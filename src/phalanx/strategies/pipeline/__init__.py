"""Pipeline model parallelism, optionally × data parallelism: ``torch.distributed.pipelining`` is the engine.

Each worker holds one stage, a contiguous run of the model's blocks. A step cuts the batch into
M micro-batches; stage s receives micro-batch activations from s−1 and sends its outputs to s+1
(point-to-point, in the order GPipe or 1F1B prescribes), and the gradients flow back the same
way. Every stage of a pipeline loads the same batch: the first stage feeds the inputs, the last
one the labels. The last stage alone knows the loss, so :meth:`global_losses` sums it over the
ranks (the others add zero); :meth:`evaluate` runs the pipeline forward and sums the last
stages' counts; a checkpoint is written by every rank, its own stage's part under the unsplit model's
names (torch's distributed checkpoint, as fsdp's: see ``train/sharded.py``), no rank gathering the model.

With W = R·P workers for P stages, R replicas of the pipeline train side by side on a 2-D device
mesh (stages × replicas; rank = stage·R + replica, so one stage's replicas are neighbours, as in
torchtitan): each replica reads its own data shard and runs its own schedule over its pipeline
group; after the schedule each stage averages its gradients and its floating-point buffers
(BatchNorm's running statistics) over its replica group (one flat all-reduce; see
:meth:`PipelineRuntime._average_over_replicas` for why not DDP), so every replica takes the same
step, the step of the unsplit model on the R shards together, and holds the same buffers. W = P
is one pipeline, rank r = stage r, exactly as without replicas.

What phalanx adds to the engine (helpers in ``phalanx/pipeline/``): the split (any
``nn.Sequential`` or ``pipeline_blocks()`` cut at its blocks; any other model, a step of the user's or
``--split-points``: the training step traced by torch.export and split at named points, tied weights
kept on every stage that uses them with their gradients summed over those stages), the exact balancing by parameters or measured time,
the printed plan, each stage's input and output worked out ahead on meta tensors (torch's static
mode: no extra pass through a stage, see ``pipeline/stage.py``), contiguous activations and
gradients (gloo needs them), sharded checkpoints any partition can read, and the checks that name the fix.

Equivalence: the engine computes the loss per micro-batch and divides the summed gradients by
M, so with a mean-reduced loss and equal micro-batches a step equals the unsplit model's step on
the whole batch. ``accumulate`` folds into the micro-batches (M = chunks × accumulate).

One stage (world size 1) runs the model in-process, micro-batched the same way, with no engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .costs import PipelineCost
from ...errors import PhalanxError
from ...options import option
from . import state as opt_state
from ..balance import Balance, bounds, check_counts, check_stages, parse_balance, partition
from .plan import StagePlan
from .messages import interpolate, time_messages
from .profile import agree, describe, profile_order, time_blocks
from .split import StageModule, has_blocks, model_blocks, parameter_counts
from .trace import candidate_points, check_points, flat_tensors, parse_points, segment_params
from .traced import TracedStage, stage_optimizer
from ...shard_read import ALIASES, model_aliases
from ...data import batch as tree
from ...task.step import DefaultStep
from ...task.metrics import Totals
from ..base import (COUNT_CORRECT, Batch, Build, Job, Layout, Options, RankPlan, Report, Role, Runtime,
                   as_batch, load_model_state, require_positive)
from ..registry import register

SCHEDULES = ("gpipe", "1f1b")


def _schedule_class(name: str):
    from torch.distributed.pipelining import Schedule1F1B

    from .schedule import GPipeAhead

    return {"gpipe": GPipeAhead, "1f1b": Schedule1F1B}[name]


@dataclasses.dataclass(frozen=True)
class Pipeline(Options):
    """Split the model into stages, one per worker, and pipeline micro-batches through them."""

    name: ClassVar[str] = "pipeline"
    estimated_on_pairs: ClassVar[bool] = True
    sharded_checkpoints: ClassVar[bool] = True
    summary: ClassVar[str] = ("model parallelism: the network split into contiguous stages, one per worker, "
                              "micro-batches pipelined; torch.distributed.pipelining")

    stages: Optional[int] = option(None, "pipeline stages, one worker each", show="the number of workers")
    chunks: int = option(4, "micro-batches per step (M); the batch must split into M equal parts")
    schedule: str = option("gpipe", "all forwards then all backwards, or interleaved (fewer live activations)",
                           choices=SCHEDULES)
    balance: Balance = option("auto", "how blocks are split: by measured time where a batch is at hand, by "
                                      "parameter count, by time, or blocks per stage like 3,2",
                              parse=parse_balance, show="auto")
    profile_repeats: int = option(5, "timed passes, each over one step's micro-batches, when balancing by time")
    split_points: tuple = option((), "submodules where a stage begins, like transformer.h.1 (the model traced by "
                                     "torch.export and split there); default: between its repeated blocks",
                                 parse=parse_points, show="between repeated blocks")

    def __post_init__(self) -> None:
        self._set(schedule=str(self.schedule).lower())
        if self.schedule not in SCHEDULES:
            raise PhalanxError(f"unknown --schedule {self.schedule!r}: choose gpipe or 1f1b")
        require_positive("--chunks", self.chunks)
        require_positive("--profile-repeats", self.profile_repeats)
        if self.stages is not None:
            require_positive("--stages", self.stages)
        self._set(balance=parse_balance(self.balance), split_points=parse_points(self.split_points))
        if self.split_points and isinstance(self.balance, tuple):
            raise PhalanxError("--split-points and --balance 3,2 both say where stages begin: give one of them")
        if self.stages is not None:
            self._check_stages(self.stages)

    def _check_stages(self, stages: int) -> None:
        if self.split_points and len(self.split_points) + 1 != stages:
            raise PhalanxError(f"--split-points {','.join(self.split_points)} makes {len(self.split_points) + 1} stages "
                               f"but the pipeline has {stages}; name {stages - 1} point(s), one where each stage after "
                               "the first begins")
        if isinstance(self.balance, tuple) and len(self.balance) != stages:
            shown = ",".join(map(str, self.balance))
            raise PhalanxError(f"--balance {shown} names {len(self.balance)} stages but the pipeline has {stages}; "
                               "give one block count per stage")
        if self.schedule == "1f1b" and self.chunks < stages:
            raise PhalanxError(f"--schedule 1f1b needs at least one micro-batch per stage: --chunks {self.chunks} < "
                               f"{stages} stages; use --chunks {stages} or more, or --schedule gpipe")

    def layout(self, job: Job) -> Layout:
        processes = job.processes or job.workers
        stages = self.stages or processes
        replicas = check_mesh(stages, processes)
        self._check_stages(stages)
        micro = self.chunks * job.accumulate
        if job.batch_size is not None and job.batch_size % micro:
            raise PhalanxError(
                f"batch {job.batch_size} does not split into {micro} equal micro-batches (--chunks {self.chunks}"
                f"{f' x --accumulate {job.accumulate}' if job.accumulate > 1 else ''}): {job.batch_size} / {micro} = "
                f"{job.batch_size / micro:g}; use a --batch-size divisible by {micro}"
            )
        if job.model is not None:
            blocks = self._check_model(job.model, stages)
            if isinstance(self.balance, tuple):
                check_counts(self.balance, blocks, stages)
        # Every stage of one replica reads the same batch (inputs for the first, labels for the
        # last): one data shard, and one part of the test set, per replica.
        ranks = tuple(RankPlan(Role.STAGE, mesh_label(rank, replicas), rank % replicas, (rank % replicas, replicas))
                      for rank in range(processes))
        return Layout(ranks, tuple(job.devices), shards=replicas, lockstep=True)

    def _check_model(self, model: nn.Module, stages: int) -> int:
        """Where the model can be split, checked before any worker starts; how many pieces it has."""
        if not self.traces(model):
            blocks = len(model_blocks(model))
            check_stages(blocks, stages)
            return blocks
        check_points(model, self.split_points)
        pieces = len(self.split_points) + 1 if self.split_points else len(candidate_points(model)) + 1
        if stages > pieces:
            name = type(model).__name__
            found = f"only {pieces - 1} repeated blocks" if pieces > 1 else "no repeated blocks (a ModuleList or " \
                "Sequential of one class)"
            raise PhalanxError(f"{stages} stages but {name} has {found} to begin a stage at: name the submodules "
                               "where stages begin with --split-points a,b, or make it an nn.Sequential of blocks")
        return pieces

    def traces(self, model: nn.Module, build: Optional[Build] = None) -> bool:
        """Whether the model is split by tracing (torch.export) rather than cut at its blocks: it names no
        blocks (an nn.Sequential or pipeline_blocks()), split points are given, or its batches or step
        are not (inputs, targets) through the model and the loss."""
        if self.split_points or not has_blocks(model):
            return True
        if build is None:
            return False
        return not isinstance(build.step, DefaultStep) or (build.example is not None
                                                           and not tree.is_pair(build.example))

    def describe(self, stages: Any = "one per worker", replicas: int = 1) -> str:
        copies = f" x {replicas} data-parallel replicas" if replicas > 1 else ""
        return f"pipeline ({self.stages or stages} stages{copies}, {self.chunks} micro-batches, {self.schedule})"

    def runtime(self, build: Build) -> Runtime:
        return PipelineRuntime(build, self)


# Its cost model, for phalanx estimate (costs/pipeline.py); no simulated rule yet (compare --simulate refuses it).
register(Pipeline, cost=PipelineCost())


class PipelineRuntime(Runtime):
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
        if options.traces(model, build):
            self.plan, points = self._traced_plan(model, build)
            if self.pipelined:
                self.traced = self._traced_stage(model, build, points)
                # The user's factory sees the user's model (its own groups), then keeps this stage's parameters.
                optimizer = stage_optimizer(build.make_optimizer(model), self.traced.module)
            stage = self.traced.module if self.traced is not None else model
        else:
            named = model_blocks(model)
            self.plan = self._make_plan(named, build)
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

    def _traced_plan(self, model: nn.Module, build: Build) -> tuple[StagePlan, tuple[str, ...]]:
        """Where the stages begin: the points given, or the repeated blocks balanced by measured time (where a
        batch is at hand) or parameter count."""
        options = self.options
        options._check_model(model, self.stages)
        points = options.split_points or tuple(candidate_points(model))
        params = segment_params(model, points)
        how = "explicit" if options.split_points or isinstance(options.balance, tuple) else options.balance
        if how == "auto":
            how = "time" if build.example is not None and self.pipelined else "params"
        if how == "time" and build.example is None:
            raise PhalanxError("--balance time needs a batch to profile the pieces on: give Build(example=...), "
                               "or use --balance params")
        plan = StagePlan((), ["(start)", *points], params, None, how, options.chunks, options.schedule,
                         self.replicas)
        if how == "time":
            self._measure_pieces(model, build, points, plan)
        if options.split_points:
            counts = (1,) * len(params)
        elif isinstance(options.balance, tuple):
            check_counts(options.balance, len(params), self.stages)
            counts = options.balance
        else:
            counts = partition(plan.seconds if how == "time" else params, self.stages)
        plan.counts = tuple(counts)
        plan.traced = tuple(points[lo - 1] for lo, _ in bounds(counts)[1:])
        return plan, plan.traced

    def _measure_pieces(self, model: nn.Module, build: Build, points: tuple[str, ...], plan: StagePlan) -> None:
        """Every piece's time, measured in every worker at once on one step's micro-batches, agreed by all ranks
        (the median per piece), as :meth:`_measure` does for blocks; messages are not timed here."""
        from .trace_profile import time_pieces

        micro = self.options.chunks * build.accumulate
        example = tree.to_device(build.example, self.ctx.device)
        parts = tree.split(example, micro)
        barrier = dist.barrier if self.ctx.distributed else None
        mine = time_pieces(model, build.step, parts, points, self.ctx.device, self.options.profile_repeats,
                           schedule=profile_order(self.options.schedule, self.ctx.device), barrier=barrier)
        plan.seconds, ranks = self._agreed(mine.seconds)
        plan.output_bytes = mine.output_bytes
        firsts = [flat_tensors(part)[0][0] for part in parts]  # (what describe counts a micro-batch's examples in)
        plan.conditions = describe(self.ctx.device, firsts, self.options.schedule, self.options.profile_repeats,
                                   ranks, self.ctx.distributed)

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

    def _make_plan(self, named: list[tuple[str, nn.Module]], build: Build) -> StagePlan:
        options, blocks = self.options, [b for _, b in named]
        check_stages(len(blocks), self.stages)
        how = "explicit" if isinstance(options.balance, tuple) else options.balance
        example = build.example[0] if build.example is not None else None
        if how == "auto":
            how = "time" if example is not None else "params"
        if how == "time" and example is None:
            raise PhalanxError("--balance time needs a batch to profile the blocks on: give Build(example=...), "
                               "or use --balance params")
        if how == "explicit":
            check_counts(options.balance, len(blocks), self.stages)  # before measuring: a bad plan fails at once
        params = parameter_counts(blocks)
        plan = StagePlan((), [n for n, _ in named], params, None, how, options.chunks, options.schedule,
                         self.replicas)
        if example is not None:
            self._measure(blocks, example, plan)
        if how == "explicit":
            plan.counts = tuple(options.balance)
        else:
            plan.counts = partition(plan.seconds, self.stages, plan.boundary()) if how == "time" else \
                partition(params, self.stages)
        return plan

    def _measure(self, blocks: list[nn.Module], example: torch.Tensor, plan: StagePlan) -> None:
        """Every block's time and every cut's message, measured as the stages will run, agreed by all ranks.

        Every rank times every block at once (see ``pipeline/profile.py``) on one step's
        micro-batches; the ranks all-gather their figures and take the median per block. Then
        neighbouring stages time the messages a cut could send (``pipeline/messages.py``).
        """
        micro = self.options.chunks * self.build.accumulate
        size = max(1, len(example) // micro)
        parts = list(example[: size * micro].split(size)) if len(example) >= micro else [example]
        barrier = dist.barrier if self.ctx.distributed else None
        mine = time_blocks(blocks, parts, self.ctx.device, self.options.profile_repeats,
                           schedule=profile_order(self.options.schedule, self.ctx.device), barrier=barrier)
        plan.seconds, ranks = self._agreed(mine.seconds)
        plan.output_bytes = mine.output_bytes
        plan.conditions = describe(self.ctx.device, parts, self.options.schedule, self.options.profile_repeats,
                                   ranks, self.ctx.distributed)
        if self.stages > 1:
            pipeline = [stage * self.replicas + self.replica for stage in range(self.stages)]
            sizes, seconds = time_messages(mine.output_bytes[:-1], pipeline, self.stage_index, self.ctx.device,
                                           self.pipe_group)
            plan.message = [interpolate(sizes, seconds, n) for n in mine.output_bytes]

    def _agreed(self, seconds: list[float]) -> tuple[list[float], int]:
        """The median over every rank of each piece's ``seconds`` (an all-gather), and the ranks counted."""
        rows: list = [seconds]
        if self.ctx.distributed:
            rows = [None] * self.ctx.world_size
            dist.all_gather_object(rows, seconds)
        return agree(rows), len(rows)

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
        for p in params:
            if p.grad is None:  # every replica must send the same layout
                p.grad = torch.zeros_like(p)
        shared = [p.grad for p in params] + [b for b in self.stage_module.buffers() if b.is_floating_point()]
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

    # ---- checkpoints ----
    def state_dict(self) -> Optional[dict[str, Any]]:
        """Rank 0 gets the whole model's state_dict and one optimizer state (see ``pipeline/state.py``).

        Called on every rank; only replica 0's stages take part (replicas hold the same state).
        """
        if not self.pipelined:
            return super().state_dict()
        if self.replica != 0:
            return None  # every replica holds the same weights and optimizer state: replica 0's are saved
        weights = self.traced.state() if self.traced is not None else self.stage_module.full_state_dict()
        part = (weights, opt_state.to_global(self.optimizer.state_dict(), self.local_to_global))
        parts: Optional[list] = [None] * self.stages if self.ctx.rank == 0 else None
        dist.gather_object(part, parts, dst=0, group=self.pipe_group)  # replica 0's pipeline; rank 0 is stage 0
        if parts is None:
            return None
        # Traced: the whole model's keys in its order, a parameter no stage uses as it started (nothing moved it).
        model = {k: v.detach().cpu() for k, v in self.build.model.state_dict().items()} if self.traced else {}
        for weights, _ in parts:
            model.update(weights)
        return {"model": model, "optimizer": opt_state.merge([o for _, o in parts])}

    @property
    def writes_shards(self) -> bool:
        # On 2+ workers (stages or replicas): each rank its own part, none holding the whole model's state.
        return self.ctx.distributed

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's part of the checkpoint, under the unsplit model's keys: its stage's parameters and
        buffers, and their optimizer state by parameter name (see ``pipeline/state.py``). Local: no collective.

        What several ranks hold alike, DCP writes once (its save plan keeps one rank's copy of an entry that
        several ranks name): a stage's replicas (equal after every step), a tied weight on two stages (equal:
        its gradients are summed between them), the optimizer's param groups (every rank lists the unsplit
        optimizer's). A tied weight's second key (``aliases``) is not saved again: readers restore it."""
        local = opt_state.by_name(self.optimizer.state_dict(), self._local_names(), self._whole_groups())
        aliases = model_aliases(self.build.model)  # (the whole model's: the same entry on every rank)
        model = {key: value for key, value in self._stage_state().items() if key not in aliases}
        return {"model": model, "optimizer": local, ALIASES: aliases}

    def _stage_state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers under the unsplit model's keys."""
        if not self.pipelined:
            return self.stage_module.state_dict()
        return self.traced.state() if self.traced is not None else self.stage_module.full_state_dict()

    def _local_names(self) -> list[str]:
        """The unsplit model's name of each parameter of this stage's optimizer, in its order."""
        names = [name for name, _ in self.build.model.named_parameters()]  # (model.parameters()'s order)
        return [names[i] for i in self.local_to_global]

    def _whole_groups(self) -> list[list[str]]:
        """The names in each param group of the optimizer the user's factory makes for the unsplit model (its
        order is what a plain optimizer numbers by: sync reads the checkpoint in it). Made once, with no state."""
        if self._groups is None:
            whole = self.optimizer if not self.pipelined else self.build.make_optimizer(self.build.model)
            self._groups = opt_state.group_names(whole, self.build.model)
        return self._groups

    def _load_shards(self, state: dict[str, Any]) -> None:
        """This rank reads its own part of a sharded checkpoint by name, whatever partition, stage count or
        strategy wrote it (the keys are the unsplit model's); nothing else is read, no collective."""
        names = self._local_names()
        weights, optimizer = opt_state.read_part(state["shards"], list(self._stage_state()), names,
                                                 model_aliases(self.build.model), "optimizer" in state["shard_keys"])
        self._load_weights(weights)
        if optimizer is not None:
            self.optimizer.load_state_dict(opt_state.from_names(optimizer, names, self.optimizer))

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """This stage's parameters and buffers from ``weights`` (the unsplit model's keys: all, or this stage's)."""
        if not self.pipelined:
            load_model_state(self.stage_module, weights)
        elif self.traced is not None:  # the stage's tensors are the model's own (the rest as they are: unused here)
            load_model_state(self.build.model, {**self.build.model.state_dict(), **weights})
        else:
            self.stage_module.load_full_state_dict(weights)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every stage takes its blocks' weights and its parameters' optimizer state: from a sharded
        checkpoint its own part only (:meth:`_load_shards`), from a whole one its share."""
        if "shards" in state:
            return self._load_shards(state)
        if not self.pipelined:
            return super().load_state_dict(state)
        self._load_weights(state["model"])
        if "optimizer" in state:  # absent: the run changed optimizers and starts this one fresh
            self.optimizer.load_state_dict(opt_state.split(state["optimizer"], self.local_to_global))

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


def check_mesh(stages: int, processes: int) -> int:
    """Replicas of a ``stages``-stage pipeline on ``processes`` workers; a clear error unless a whole number."""
    if processes < stages:
        raise PhalanxError(f"--stages {stages} needs {stages} workers (one per stage) but this run has "
                           f"{processes}; add --workers {stages}")
    if processes % stages:
        below, above = processes // stages * stages, -(-processes // stages) * stages
        raise PhalanxError(f"--workers {processes} is not a multiple of --stages {stages} ({processes} / {stages} = "
                           f"{processes / stages:.3g} replicas of the pipeline); use --workers {below} or {above}")
    return processes // stages


def mesh_label(rank: int, replicas: int) -> str:
    """How messages name a rank: ``stage 1 (rank 1)``, or ``stage 1 replica 0 (rank 2)`` on a 2-D mesh."""
    stage, replica = divmod(rank, replicas)
    return f"stage {stage} (rank {rank})" if replicas == 1 else f"stage {stage} replica {replica} (rank {rank})"


__all__ = ["Pipeline", "SCHEDULES", "check_mesh", "mesh_label"]
