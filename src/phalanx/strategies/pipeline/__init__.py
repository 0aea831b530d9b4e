"""Pipeline model parallelism, optionally × data parallelism: ``torch.distributed.pipelining`` is the engine.

Each worker holds one stage, a contiguous run of the model's blocks. A step cuts the batch into
M micro-batches; stage s receives micro-batch activations from s−1 and sends its outputs to s+1
(point-to-point, in the order GPipe or 1F1B prescribes), and the gradients flow back the same
way. Every stage of a pipeline loads the same batch: the first stage feeds the inputs, the last
one the labels. The last stage alone knows the loss, so :meth:`global_losses` sums it over the
ranks (the others add zero); :meth:`evaluate` runs the pipeline forward and sums the last
stages' counts; a checkpoint is written by every rank, its own stage's part under the unsplit model's
names (torch's distributed checkpoint, as fsdp's: see ``checkpoint/dcp.py``), no rank gathering the model.

With W = R·P workers for P stages, R replicas of the pipeline train side by side on a 2-D device
mesh (stages × replicas; rank = stage·R + replica, so one stage's replicas are neighbours, as in
torchtitan): each replica reads its own data shard and runs its own schedule over its pipeline
group; after the schedule each stage averages its gradients and its floating-point buffers
(BatchNorm's running statistics) over its replica group (one flat all-reduce; see
:meth:`~.runtime.PipelineRuntime._average_over_replicas` for why not DDP), so every replica takes the same
step, the step of the unsplit model on the R shards together, and holds the same buffers. W = P
is one pipeline, rank r = stage r, exactly as without replicas.

What phalanx adds to the engine (this package's modules): the split (any
``nn.Sequential`` or ``pipeline_blocks()`` cut at its blocks; any other model, a step of the user's or
``--split-points``: the training step traced by torch.export and split at named points, tied weights
kept on every stage that uses them with their gradients summed over those stages), the exact balancing
by parameters or measured time,
the printed plan, each stage's input and output worked out ahead on meta tensors (torch's static
mode: no extra pass through a stage, see ``stage.py``), contiguous activations and
gradients (gloo needs them), sharded checkpoints any partition can read, and the checks that name the fix.

Here: the options, their layout and the registration. The runtime is ``runtime.py`` (where the model is
cut: ``planner.py``; checkpoints: ``checkpoint.py``; the mesh's arithmetic: ``mesh.py``).

Equivalence: the engine computes the loss per micro-batch and divides the summed gradients by
M, so with a mean-reduced loss and equal micro-batches a step equals the unsplit model's step on
the whole batch. ``accumulate`` folds into the micro-batches (M = chunks × accumulate).

One stage (world size 1) runs the model in-process, micro-batched the same way, with no engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

from torch import nn

from ...data import batch as tree
from ...errors import PhalanxError
from ...options import option
from ...task.step import calls_model_alone
from ..balance import Balance, check_counts, check_stages, parse_balance
from ..base import Build, Runtime
from ..options import Options, require_positive
from ..layout import Job, Layout, RankPlan, Role
from ..registry import register
from .costs import PipelineCost
from .mesh import check_mesh, mesh_label
from .runtime import PipelineRuntime
from .split import has_blocks, model_blocks
from .trace import candidate_points, check_points, parse_points

SCHEDULES = ("gpipe", "1f1b")


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
            raise PhalanxError(f"--split-points {','.join(self.split_points)} makes "
                               f"{len(self.split_points) + 1} stages "
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
        return not calls_model_alone(build.step, model) or (build.example is not None
                                                           and not tree.is_pair(build.example))

    def rehearse(self, model: nn.Module, example: Any, step: Any) -> None:
        if self.traces(model) or not calls_model_alone(step, model) or not tree.is_pair(example):
            from .rehearse import rehearse  # (traces: only where a pipeline is planned)

            rehearse(model, self.split_points, example, step)

    def describe(self, stages: Any = "one per worker", replicas: int = 1) -> str:
        copies = f" x {replicas} data-parallel replicas" if replicas > 1 else ""
        return f"pipeline ({self.stages or stages} stages{copies}, {self.chunks} micro-batches, {self.schedule})"

    def runtime(self, build: Build) -> Runtime:
        return PipelineRuntime(build, self)


# Its cost model, for phalanx estimate (costs.py); no simulated rule yet (compare --simulate refuses it).
register(Pipeline, cost=PipelineCost())


__all__ = ["Pipeline", "SCHEDULES", "check_mesh", "mesh_label"]
