"""Pipeline model parallelism: ``torch.distributed.pipelining`` is the engine.

Each worker holds one stage, a contiguous run of the model's blocks (rank r = stage r). A step
cuts the batch into M micro-batches; stage r receives micro-batch activations from r−1 and sends
its outputs to r+1 (point-to-point, in the order GPipe or 1F1B prescribes), and the gradients
flow back the same way. Every rank loads the same whole batch: the first stage feeds the inputs,
the last one the labels. The last stage alone knows the loss, so :meth:`global_loss` broadcasts
it; :meth:`evaluate` runs the pipeline forward and broadcasts the last stage's counts; a
checkpoint gathers every stage's parameters and optimizer state to rank 0 as one whole model.

What phalanx adds to the engine: the split (any ``nn.Sequential`` or ``pipeline_blocks()``), the
exact balancing by parameters or measured time, the printed plan, contiguous activations and
gradients (gloo needs them), one consistent checkpoint, and the checks that name the fix.

Equivalence: the engine computes the loss per micro-batch and divides the summed gradients by
M, so with a mean-reduced loss and equal micro-batches a step equals the unsplit model's step on
the whole batch. ``accumulate`` folds into the micro-batches (M = chunks × accumulate).

One stage (world size 1) runs the model in-process, micro-batched the same way, with no engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PhalanxError
from ..launch import WorkerContext
from ..strategies.base import LossFn, OptimizerFactory, Strategy, require_positive
from . import state as opt_state
from .balance import Balance, bounds, check_counts, check_stages, parse_balance, partition
from .plan import StagePlan
from .profile import time_blocks
from .split import StageModule, model_blocks, parameter_counts

SCHEDULES = ("gpipe", "1f1b")


def _schedule_class(name: str):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]


@dataclasses.dataclass
class Pipeline(Strategy):
    """Split the model into stages, one per worker, and pipeline micro-batches through them."""

    name: ClassVar[str] = "pipeline"
    #: number of stages; one worker each (None: as many as there are workers)
    stages: Optional[int] = None
    #: micro-batches per step (M); the batch must split into M equal parts
    chunks: int = 4
    #: "gpipe" (all forwards, then all backwards) or "1f1b" (interleaved; fewer live activations)
    schedule: str = "gpipe"
    #: "auto" (time when a batch is at hand, else params), "params", "time", or blocks per stage
    balance: Union[str, Sequence[int]] = "auto"
    #: timed passes per block when balancing by time
    profile_repeats: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        self.schedule = str(self.schedule).lower()
        if self.schedule not in SCHEDULES:
            raise PhalanxError(f"unknown --schedule {self.schedule!r}: choose gpipe or 1f1b")
        require_positive("--chunks", self.chunks)
        require_positive("profile_repeats", self.profile_repeats)
        if self.stages is not None:
            require_positive("--stages", self.stages)
        self.balance = parse_balance(self.balance)
        if self.stages is not None:
            self._check_layout(self.stages)
        self.plan: Optional[StagePlan] = None
        self._example: Optional[torch.Tensor] = None
        self._stage = None
        self._schedules: dict[Any, Any] = {}
        self.local_to_global: list[int] = []

    # ---- before any worker starts ----
    def _check_layout(self, stages: int) -> None:
        if isinstance(self.balance, tuple) and len(self.balance) != stages:
            shown = ",".join(map(str, self.balance))
            raise PhalanxError(f"--balance {shown} names {len(self.balance)} stages but the pipeline has {stages}; "
                               "give one block count per stage")
        if self.schedule == "1f1b" and self.chunks < stages:
            raise PhalanxError(f"--schedule 1f1b needs at least one micro-batch per stage: --chunks {self.chunks} < "
                               f"{stages} stages; use --chunks {stages} or more, or --schedule gpipe")

    def check_world(self, world_size: int, devices: list[torch.device]) -> None:
        stages = self.stages or world_size
        if stages != world_size:
            raise PhalanxError(f"--stages {stages} needs {stages} workers (one per stage) but this run has "
                               f"{world_size}; add --workers {stages}")
        self._check_layout(stages)

    def check_batch(self, batch_size: int, accumulate: int = 1) -> None:
        micro = self.chunks * accumulate
        if batch_size % micro:
            raise PhalanxError(
                f"batch {batch_size} does not split into {micro} equal micro-batches (--chunks {self.chunks}"
                f"{f' x --accumulate {accumulate}' if accumulate > 1 else ''}): {batch_size} / {micro} = "
                f"{batch_size / micro:g}; use a --batch-size divisible by {micro}"
            )

    def describe(self) -> str:
        stages = self.plan.stages if self.plan else (self.stages or "one per worker")
        return f"pipeline ({stages} stages, {self.chunks} micro-batches, {self.schedule})"

    # ---- inside a worker ----
    def data_shard(self, ctx: WorkerContext) -> tuple[int, int]:
        return 0, 1  # every stage sees the whole batch: inputs for the first, labels for the last

    def example_batch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._example = x

    @property
    def num_stages(self) -> int:
        return self.plan.stages if self.plan else (self.stages or 1)

    @property
    def is_first(self) -> bool:
        return self.ctx is None or self.ctx.rank == 0

    @property
    def is_last(self) -> bool:
        return self.ctx is None or self.ctx.rank == self.num_stages - 1

    def setup(self, ctx: WorkerContext, model: nn.Module, make_optimizer: OptimizerFactory):
        self.ctx = ctx
        stages = self.stages or ctx.world_size
        self.check_world(ctx.world_size, [ctx.device])
        named = model_blocks(model)
        self.plan = self._make_plan(named, stages, ctx)
        index = {id(p): i for i, p in enumerate(model.parameters())}
        if stages == 1:
            self.model = model  # one stage: the whole model, run in-process with no engine
        else:
            lo, hi = bounds(self.plan.counts)[ctx.rank]
            self.model = StageModule(named[lo:hi])
        self.local_to_global = [index[id(p)] for p in self.model.parameters()]
        self.optimizer = make_optimizer(self.model.parameters())
        if stages > 1:
            from torch.distributed.pipelining import PipelineStage

            self._stage = PipelineStage(self.model, ctx.rank, stages, ctx.device)
        return self.model, self.optimizer

    def _make_plan(self, named: list[tuple[str, nn.Module]], stages: int, ctx: WorkerContext) -> StagePlan:
        blocks = [b for _, b in named]
        check_stages(len(blocks), stages)
        how = "explicit" if isinstance(self.balance, tuple) else self.balance
        if how == "auto":
            how = "time" if self._example is not None else "params"
        if how == "time" and self._example is None:
            raise PhalanxError("--balance time needs a batch to profile the blocks on: call "
                               "strategy.example_batch(x, y) before setup(), or use --balance params")
        if how == "explicit":
            check_counts(self.balance, len(blocks), stages)  # before measuring: a bad plan fails at once
        params = parameter_counts(blocks)
        seconds = self._measure(blocks, ctx) if self._example is not None else None
        if how == "explicit":
            counts = tuple(self.balance)
        else:
            counts = partition(seconds if how == "time" else params, stages)
        return StagePlan(counts, [n for n, _ in named], params, seconds, how, self.chunks, self.schedule)

    def _measure(self, blocks: list[nn.Module], ctx: WorkerContext) -> list[float]:
        """Per-block seconds, averaged over ranks so that every rank computes the same partition."""
        micro = self._example[: max(1, len(self._example) // self.chunks)]
        seconds = torch.tensor(time_blocks(blocks, micro, ctx.device, self.profile_repeats), dtype=torch.float64)
        if ctx.distributed:
            seconds = seconds.to(ctx.device)
            dist.all_reduce(seconds)
            seconds = seconds.cpu() / ctx.world_size
        return seconds.tolist()

    def header_lines(self) -> list[str]:
        return self.plan.lines() if self.plan else []

    # ---- a training step ----
    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, accumulate: int = 1) -> torch.Tensor:
        micro = self.chunks * accumulate
        self.check_batch(len(x), accumulate)
        if self._stage is None:
            return super().train_step(x, y, loss_fn, micro)
        schedule = self._training_schedule(micro, loss_fn)
        losses: list[torch.Tensor] = []
        if self.is_first:
            schedule.step(x, return_outputs=False)
        elif self.is_last:
            schedule.step(target=y, losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.is_last:
            return torch.stack([loss.detach() for loss in losses]).mean()
        return torch.zeros((), device=self.ctx.device)  # only the last stage knows it: see global_loss

    def _training_schedule(self, micro: int, loss_fn: LossFn):
        key = ("train", micro, loss_fn)
        if key not in self._schedules:
            # scale_grads: the engine divides the summed micro-batch gradients by M, which with a
            # mean loss per micro-batch is the gradient of the mean over the whole batch.
            self._schedules[key] = _schedule_class(self.schedule)(self._stage, micro, loss_fn=loss_fn,
                                                                  scale_grads=True)
        return self._schedules[key]

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's loss, on every rank (broadcast from it)."""
        if self._stage is None:
            return loss
        out = loss.detach().reshape(()).to(self.ctx.device, torch.float32).clone()
        dist.broadcast(out, src=self.num_stages - 1)
        return out

    # ---- evaluation ----
    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device
                 ) -> tuple[int, int]:
        """(correct, total) over the batches, which every rank must be given identically."""
        if self._stage is None:
            return super().evaluate(batches, device)
        was_training = self.model.training
        self.model.eval()
        counts = torch.zeros(2, dtype=torch.float64)
        for x, y in batches:
            schedule = self._eval_schedule(tuple(x.shape), x.dtype)
            if self.is_first:
                schedule.eval(x.to(device))
            elif self.is_last:
                predicted = schedule.eval().argmax(1).cpu()
                counts += torch.tensor([(predicted == y).sum().item(), len(y)], dtype=torch.float64)
            else:
                schedule.eval()
        self.model.train(was_training)
        counts = counts.to(device)
        dist.broadcast(counts, src=self.num_stages - 1)
        return int(counts[0]), int(counts[1])

    def _eval_schedule(self, shape: tuple, dtype: torch.dtype):
        """A forward-only schedule for batches of this shape (the engine fixes shapes at first use)."""
        key = ("eval", shape, dtype)
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            micro = max(m for m in range(1, min(self.chunks, shape[0]) + 1) if shape[0] % m == 0)
            stage = PipelineStage(self.model, self.ctx.rank, self.num_stages, self.ctx.device)
            self._schedules[key] = ScheduleGPipe(stage, micro, loss_fn=None, scale_grads=False)
        return self._schedules[key]

    # ---- checkpoints ----
    def checkpoint_state(self) -> Optional[dict[str, Any]]:
        """Rank 0 gets the whole model's state_dict and one optimizer state (see ``state.py``)."""
        if self._stage is None:
            return super().checkpoint_state()
        part = (self.model.full_state_dict(), opt_state.to_global(self.optimizer.state_dict(), self.local_to_global))
        parts: Optional[list] = [None] * self.ctx.world_size if self.ctx.rank == 0 else None
        dist.gather_object(part, parts, dst=0)
        if parts is None:
            return None
        model: dict[str, torch.Tensor] = {}
        for weights, _ in parts:
            model.update(weights)
        return {"model": model, "optimizer": opt_state.merge([o for _, o in parts])}

    def load_state(self, state: dict[str, Any]) -> None:
        """Every stage takes its blocks' weights and its parameters' optimizer state."""
        if self._stage is None:
            return super().load_state(state)
        self.model.load_full_state_dict(state["model"])
        self.optimizer.load_state_dict(opt_state.split(state["optimizer"], self.local_to_global))

    def stats(self, final: bool = False) -> dict[str, Any]:
        if self.plan is None:
            return {}
        return {"stages": self.plan.stages, "chunks": self.chunks, "schedule": self.schedule,
                "balance": list(self.plan.counts), "predicted_bubble": round(self.plan.bubble(), 4)}

    def close(self) -> None:
        self._schedules.clear()
        self._stage = None


__all__ = ["Pipeline", "SCHEDULES", "Balance"]
