"""What every strategy provides, so that the training loop never asks which one it holds.

A strategy is a small validated dataclass (its options) that, inside a worker, wraps the user's
model and optimizer and keeps their interfaces: the model is still an ``nn.Module`` called as
``model(x)``, the optimizer still has ``step``/``zero_grad``/``state_dict``/``param_groups``.
Communication hides behind those calls (DDP's backward hooks; an optimizer whose ``step`` talks
to a server; an averager after ``step``). The loop calls, per global step:

    loss = strategy.train_step(x, y)         # forward + backward, micro-batched for accumulation
    loss = strategy.global_loss(loss)        # the loss every worker agrees on (NaN guard, logs)

World size 1 runs every strategy unchanged in one process with no process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ClassVar, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PhalanxError
from ..launch import WorkerContext

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class Strategy:
    """Base class: options are dataclass fields, validated in ``__post_init__``."""

    name: ClassVar[str] = "base"
    #: True when every rank takes every global step together, so the loop may use collectives
    #: at checkpoints (gathering every rank's RNG state); asynchronous strategies set False.
    lockstep: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.total_steps: Optional[int] = None  # set by the training loop before setup()
        self.ctx: Optional[WorkerContext] = None
        self.model: Optional[nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None

    # ---- what the launcher needs to know before any worker starts ----
    def check_world(self, world_size: int, devices: list[torch.device]) -> None:
        """Raise PhalanxError if this strategy cannot run on ``world_size`` workers."""

    def plan_devices(self, devices: list[torch.device]) -> list[torch.device]:
        """The devices in worker order (a strategy may reorder them, e.g. by topology islands)."""
        return devices

    def check_batch(self, batch_size: int, accumulate: int = 1) -> None:
        """Raise PhalanxError if a batch of ``batch_size`` per worker cannot be used (checked in the parent)."""

    def role(self, rank: int) -> str:
        """How error messages name this rank."""
        return f"worker {rank}"

    def tolerates_loss_of(self, rank: int) -> bool:
        """Whether the job may go on when this rank's process dies (the launcher asks)."""
        return False

    def describe(self) -> str:
        """One phrase for the run header."""
        return self.name

    def header_lines(self) -> list[str]:
        """More lines for the run header, once setup() has run (e.g. a pipeline's stage plan)."""
        return []

    def data_shard(self, ctx: WorkerContext) -> tuple[int, int]:
        """(shard index, shard count) of the data this worker reads.

        Data parallel strategies give every rank its own shard (the default); a strategy whose
        ranks share one batch (a pipeline's stages) returns ``(0, 1)``. The global batch is
        batch size x shard count.
        """
        return ctx.rank, ctx.world_size

    def eval_shard(self, ctx: WorkerContext) -> tuple[int, int]:
        """(shard index, shard count) of the test set this worker evaluates."""
        return self.data_shard(ctx)

    def example_batch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One batch as this worker will see it, given before setup() (for strategies that profile the model)."""

    # ---- inside a worker ----
    def setup(self, ctx: WorkerContext, model: nn.Module, make_optimizer: OptimizerFactory
              ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap ``model`` (already on ``ctx.device``) and build its optimizer."""
        self.ctx, self.model = ctx, model
        self.optimizer = make_optimizer(model.parameters())
        return self.model, self.optimizer

    @property
    def module(self) -> nn.Module:
        """The user's bare model (for checkpoints and evaluation)."""
        return self.model

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Inside it, backward passes accumulate locally without communicating."""
        return contextlib.nullcontext()

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, accumulate: int = 1) -> torch.Tensor:
        """Forward and backward over ``accumulate`` micro-batches, then one optimizer step.

        Returns this worker's mean loss over its batch (detached).
        """
        assert self.model is not None and self.optimizer is not None, "setup() first"
        loss = self.forward_backward(x, y, loss_fn, accumulate)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, accumulate: int = 1
                         ) -> torch.Tensor:
        """Gradients of the mean loss over the batch, in ``accumulate`` micro-batches.

        Communication happens only on the last micro-batch's backward: the inner ones run under
        ``no_sync``.
        """
        xs, ys = x.chunk(accumulate), y.chunk(accumulate)
        total = torch.zeros((), device=x.device)
        for i, (xk, yk) in enumerate(zip(xs, ys)):
            weight = len(xk) / len(x)
            ctx = self.no_sync() if i < len(xs) - 1 else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(self.model(xk), yk)
                (loss * weight).backward()
            total += loss.detach() * weight
        return total

    def next_step(self, step: int) -> Optional[int]:
        """The global step after this worker's train_step (None: this worker is done)."""
        return step + 1

    def finish(self) -> None:
        """After the last step, before the final evaluation and checkpoint (e.g. drain a server).

        By default every rank waits for the slowest, so that the measured training time (and
        throughput) covers every worker's steps, not only rank 0's.
        """
        if self.ctx is not None and self.ctx.distributed:
            dist.barrier()

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean of ``loss`` over all workers (every rank gets the same value)."""
        if self.ctx is None or not self.ctx.distributed:
            return loss
        out = loss.detach().clone()
        dist.all_reduce(out)
        return out / self.ctx.world_size

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device
                 ) -> tuple[int, int]:
        """(correct, total) over every worker's share of the test set (a collective)."""
        model = self.module
        was_training = model.training
        model.eval()
        counts = torch.zeros(2, dtype=torch.float64)
        for x, y in batches:
            predicted = model(x.to(device)).argmax(1).cpu()
            counts += torch.tensor([(predicted == y).sum().item(), len(y)], dtype=torch.float64)
        model.train(was_training)
        if self.ctx is not None and self.ctx.distributed:
            counts = counts.to(device)
            dist.all_reduce(counts)
        return int(counts[0]), int(counts[1])

    def checkpoint_state(self) -> Optional[dict[str, Any]]:
        """Model and optimizer state to save (called on every rank; rank 0's result is written)."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`checkpoint_state` returned (on every rank)."""
        try:
            self.module.load_state_dict(state["model"])
        except RuntimeError as e:
            raise PhalanxError(
                f"checkpoint does not fit this model ({str(e).splitlines()[0][:160]}); "
                "resume with the --model and data the checkpoint was trained with"
            ) from None
        self.optimizer.load_state_dict(state["optimizer"])

    def stats(self, final: bool = False) -> dict[str, Any]:
        """Strategy-specific figures for the metrics file (``final``: the summary, may be longer)."""
        return {}

    def summary_lines(self) -> list[str]:
        """Extra lines for the summary rank 0 prints (e.g. staleness)."""
        return []

    def close(self) -> None:
        """Release what setup() took (threads, servers)."""


def require_positive(name: str, value: int) -> None:
    if value < 1:
        raise PhalanxError(f"{name} must be at least 1, got {value}")
