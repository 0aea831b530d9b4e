"""Where a worker cuts the model into stages: the stage plan, by parameter counts or by measured times.

Every worker makes the same plan. Measured times are agreed: every rank times every block (or traced
piece) at once on one step's micro-batches, the ranks all-gather their figures and take the median
per piece (see ``profile.py``, ``trace_profile.py``); neighbouring stages then time the messages a cut
could send (``messages.py``). The partition of those figures is ``strategies/balance.py``'s; the plan
it makes (and prints) is ``plan.py``'s :class:`StagePlan`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ...data import batch as tree
from ...errors import PhalanxError
from ...task.step import UserStep
from ..balance import bounds, check_counts, check_stages, partition
from ..base import Build
from .messages import interpolate, time_messages
from .plan import StagePlan
from .profile import agree, describe, profile_order, time_blocks
from .split import parameter_counts
from .trace import candidate_points, flat_tensors, segment_params

if TYPE_CHECKING:
    from . import Pipeline


@dataclasses.dataclass
class StagePlanner:
    """One worker's part in planning the split: its place on the mesh, and the run it plans for."""

    options: Pipeline
    build: Build
    stages: int
    replicas: int
    replica: int  #: this rank's replica (rank = stage x replicas + replica)
    stage_index: int
    pipe_group: Any  #: this replica's pipeline group (None: the default group, or no group at all)

    @property
    def ctx(self) -> Any:
        return self.build.ctx

    @property
    def pipelined(self) -> bool:
        return self.stages > 1

    def traced(self, model: nn.Module) -> tuple[StagePlan, tuple[str, ...]]:
        """Where the stages begin: the points given, or the repeated blocks balanced by measured time (where a
        batch is at hand) or parameter count."""
        options, build = self.options, self.build
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
                         self.replicas, users_step=isinstance(build.step, UserStep))
        if how == "time":
            self._measure_pieces(model, build, points, plan)
        if options.split_points:
            counts = (1,) * len(params)
        elif isinstance(options.balance, tuple):
            check_counts(options.balance, len(params), self.stages)
            counts = options.balance
        else:
            weights = plan.seconds if how == "time" else params
            assert weights is not None, "_measure_pieces measured every piece"
            counts = partition(weights, self.stages)
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

    def blocks(self, named: list[tuple[str, nn.Module]]) -> StagePlan:
        """How many of the model's blocks each stage takes: as given, or balanced by measured time (where a
        batch is at hand) or parameter count."""
        options, blocks, build = self.options, [b for _, b in named], self.build
        check_stages(len(blocks), self.stages)
        how = "explicit" if isinstance(options.balance, tuple) else options.balance
        example = build.example[0] if build.example is not None else None
        if how == "auto":
            how = "time" if example is not None else "params"
        if how == "time" and example is None:
            raise PhalanxError("--balance time needs a batch to profile the blocks on: give Build(example=...), "
                               "or use --balance params")
        if isinstance(options.balance, tuple):  # (how == "explicit")
            check_counts(options.balance, len(blocks), self.stages)  # before measuring: a bad plan fails at once
        params = parameter_counts(blocks)
        plan = StagePlan((), [n for n, _ in named], params, None, how, options.chunks, options.schedule,
                         self.replicas)
        if example is not None:
            self._measure(blocks, example, plan)
        if isinstance(options.balance, tuple):  # (how == "explicit")
            plan.counts = options.balance
        elif how == "time":
            assert plan.seconds is not None, "_measure measured every block"
            plan.counts = partition(plan.seconds, self.stages, plan.boundary())
        else:
            plan.counts = partition(params, self.stages)
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
