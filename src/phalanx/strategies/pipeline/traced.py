"""One rank's stage of a model split by tracing (``trace.py``), and the tied parameters it shares.

Who talks to whom: the engine's schedule sends activations and their gradients between
neighbouring stages (point-to-point, as for a model cut at its blocks); a value that a later stage
reads (the targets) travels from stage 0 directly to it. After the schedule, every parameter that
several stages hold (a GPT's embedding, which its output layer reuses) has a gradient on each of
them, each only the part its own stage's use contributed; :meth:`TracedStage.sum_tied` all-reduces
those gradients (a sum) over the ranks of one pipeline holding them, as Megatron-LM does for its
embedding and output layer, so every copy takes the same step and the copies stay one tensor's
value. The ranks of such a group are fixed for the run: every rank creates every group, in the same
order (``dist.new_group`` is collective).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...data import batch as batches
from ...task.step import StepResult
from .trace import Traced, flat_tensors, stage_tensors, tied


class TracedStage:
    """This rank's stage: traces per (mode, micro-batch shape), the tied-parameter groups, its state."""

    def __init__(self, model: nn.Module, step: Callable, points: tuple[str, ...], stages: int, index: int,
                 replicas: int, replica: int, device: torch.device, group: Any, wrap: Callable[[nn.Module], Any],
                 micro_batch: Any):
        self.model, self.step, self.points = model, step, points
        self.stages, self.index, self.device, self.group, self.wrap = stages, index, device, group, wrap
        self._traces: dict[Any, Traced] = {}
        self.schedules: dict[Any, Any] = {}  #: the engine's schedules, by (class, mode, micro-batches, shapes)
        self._outputs: list = []  #: the last stage's results of the batch being evaluated
        first = self.trace(True, micro_batch)
        self.module = first.stage_module(index)  #: the training stage (its tensors are the model's own)
        self.tied = tied(first, model, stages)  #: whole-model parameter index -> the stages holding it
        self._params = list(model.parameters())
        self._groups = _tie_groups(self.tied, replicas, replica)
        held = set().union(*(stage_tensors(first.stage_module(s)) for s in range(stages)))
        #: ids of the model's tensors that no stage holds (the step never reads them): stage 0 saves them
        self.unused = {id(t) for t in model.state_dict(keep_vars=True).values()} - held

    def trace(self, training: bool, micro_batch: Any) -> Traced:
        """The step traced in this mode for micro-batches of this shape (torch.export specialises on both)."""
        tensors = flat_tensors(micro_batch)[0]
        key = (training, tuple((tuple(t.shape), t.dtype) for t in tensors))
        if key not in self._traces:
            was = self.model.training
            self.model.train(training)
            try:
                traced = Traced(self.model, self.step, micro_batch, self.points, self.stages)
            finally:
                self.model.train(was)
            self.wrap(traced.stage_module(self.index))
            self._traces[key] = traced
        return self._traces[key]

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    def train(self, schedule_class: type, batch: Any, micro: int, losses: list) -> None:
        """One training step's schedule: every input enters the first stage; the last stage's output holds
        the step's loss, appended to ``losses`` per micro-batch."""
        tensors = flat_tensors(batch)[0]
        schedule = self.schedule(schedule_class, True, batch, micro)
        if self.is_first:
            schedule.step(*tensors, return_outputs=False)
        elif self.is_last:  # the targets travelled inside the pipeline; the engine only wants something to split
            schedule.step(target=tensors[0], losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)

    def evaluate(self, schedule_class: type, batch: Any, chunks: int, totals: Any) -> torch.Tensor:
        """The step traced in eval mode over one batch, in the most equal micro-batches up to ``chunks``; the
        last stage scores each micro-batch's result with ``totals`` (the other stages return zeros)."""
        n = batches.length(batch)
        micro = max(m for m in range(1, min(chunks, n) + 1) if n % m == 0)
        tensors = flat_tensors(batch)[0]
        schedule = self.schedule(schedule_class, False, batch, micro)
        self._outputs = []
        if self.is_first:
            schedule.eval(*tensors, return_outputs=False)
        elif self.is_last:
            schedule.eval(target=tensors[0], losses=[], return_outputs=False)
        else:
            schedule.eval(return_outputs=False)
        sums = totals.zeros()
        for made, part in zip(self._outputs, batches.split(batch, micro)):
            sums += totals.add(StepResult(*made), part)
        return sums

    def schedule(self, schedule_class: type, training: bool, batch: Any, micro: int):
        """The engine's schedule for ``micro`` micro-batches like this batch's, in this mode (one per shape: a
        trace and a stage's buffers hold for one). Its loss is the step's, read off the last stage's output;
        in evaluation every micro-batch's (loss, outputs, targets) is kept for scoring."""
        tensors = flat_tensors(batch)[0]
        key = (schedule_class, training, micro, tuple((tuple(t.shape), t.dtype) for t in tensors))
        if key not in self.schedules:
            traced = self.trace(training, batches.split(batch, micro)[0])
            stage = traced.pipe.build_stage(self.index, self.device, self.group)

            def loss_fn(output: Any, target: Any) -> torch.Tensor:
                made = traced.result(output)
                if not training:
                    self._outputs.append(made)
                return made[0]

            # scale_grads: the summed micro-batch gradients divided by M, as the cut front end's schedules do
            self.schedules[key] = schedule_class(stage, micro, loss_fn=loss_fn, scale_grads=True)
        return self.schedules[key]

    def owned(self) -> set[int]:
        """Ids of this stage's parameters that its share of the gradient norm counts: a tied one only on the
        first stage holding it (the norm is of the model's gradient, each parameter once)."""
        others = {id(self._params[i]) for i, holders in self.tied.items() if holders[0] != self.index}
        return {id(p) for p in self.module.parameters()} - others

    @torch.no_grad()
    def sum_tied(self) -> None:
        """Sum the gradients of the parameters this stage shares with others over the stages holding them
        (one flat all-reduce per group)."""
        for holders, group in self._groups.items():
            if self.index not in holders:
                continue
            params = [self._params[i] for i, h in self.tied.items() if h == holders]
            grads = []
            for p in params:
                if p.grad is None:  # this stage's use gave it none: every member must send the same layout
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    def state(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers under the whole model's keys (CPU copies); a tied one under
        each of its keys, as the unsplit model's ``state_dict`` has it. Stage 0 adds the tensors no stage
        holds (as they started: nothing moves them), so that the stages' parts make the whole model."""
        mine = stage_tensors(self.module) | (self.unused if self.is_first else set())
        return {key: value.detach().cpu() for key, value in self.model.state_dict(keep_vars=True).items()
                if id(value) in mine}


def _tie_groups(tied_params: dict[int, tuple[int, ...]], replicas: int, replica: int) -> dict[tuple, Optional[Any]]:
    """For every set of stages sharing a parameter, the process group of this replica's ranks holding it.
    Every rank creates every replica's group in the same order (collective); it keeps its own replica's."""
    mine: dict[tuple, Any] = {}
    for holders in sorted(set(tied_params.values())):
        for r in range(replicas):
            group = dist.new_group([s * replicas + r for s in holders])
            if r == replica:
                mine[holders] = group
    return mine


def stage_optimizer(optimizer: torch.optim.Optimizer, stage: nn.Module) -> torch.optim.Optimizer:
    """The optimizer the user's factory made for the whole model (its own groups: a GPT's
    ``configure_optimizers`` decays the matrices only), left with this stage's parameters: the others are
    another rank's to update. Made before any step, so no state is lost."""
    mine = {id(p) for p in stage.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in mine]
    return optimizer
