"""The shape every strategy has: options, a layout, a runtime.

- **Options** (:class:`~phalanx.strategies.options.Options`): a frozen dataclass, validated in
  ``__post_init__``; its fields, declared with :func:`phalanx.options.option`, are also the CLI flags of that
  strategy.
- **Layout** (:meth:`Options.layout`): pure, computed in the parent before any process starts,
  from a :class:`Job` (the devices, the batch, the model): how many processes, each rank's role,
  which data shard it reads, which ranks the job may lose, the device order. Every check that can
  be made without processes is made here, so bad input never reaches a worker.
- **Runtime** (:meth:`Options.runtime` -> :class:`Runtime`): built inside each worker from a
  :class:`Build`. It wraps the user's model and optimizer and keeps their interfaces, and the
  training loop calls only the few methods below, never asking which strategy it holds:

      loss = runtime.train_step(batch)      # forward, backward, update (micro-batched); any batch tree
      step = runtime.next_step(step)        # the global step now (None: this rank is done)
      losses = runtime.global_losses(losses)  # the per-step losses every rank agrees on (at log steps)
      where = runtime.nonfinite_inputs(step)  # after a non-finite loss: which inputs held NaN, if known
      runtime.arrive_for_evaluation()       # meet before a collective evaluation's clock starts
      sums = runtime.evaluate(batches, totals)  # metrics' (sum, count)s over every rank's part
      runtime.state_dict() / runtime.load_state_dict(state)    # checkpoints
      if runtime.writes_shards: runtime.shard_state_dict()     # a sharded checkpoint: this rank's part
      changed = runtime.finish(stopping)    # what the model still owes (True: it changed it)
      saved = runtime.survivor_state(step, survivors)  # a peer lost: what this rank saves without it
      runtime.report(final); runtime.close()

World size 1 runs every strategy unchanged in one process with no process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
from typing import Any, Callable, ClassVar, Iterable, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ..data import batch as batches
from ..errors import PhalanxError
from ..launcher import WorkerContext
from ..task.metrics import ACCURACY, Totals, add_up
from ..precision import Precision
from ..task.step import DefaultStep, StepResult, averages_tokens, counted_targets
from .layout import Job, Layout, RankPlan
from .options import Options

#: called with the module the strategy steps (see ``task.call_optimizer_factory``: a factory of the user's gets
#: the model where its first parameter is named ``model``, else its parameters)
OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: A pair (inputs, targets), a tuple, a dict or nested containers of tensors (see ``data/batch.py``).
Batch = Any
#: ``step(model, batch) -> StepResult``: the task's training step (see ``step.py``)
Step = Callable[[nn.Module, Any], StepResult]
#: What ``evaluate`` adds up when given nothing else: (correct, total).
COUNT_CORRECT = Totals((ACCURACY,))


# --------------------------------------------------------------------------- the runtime (worker)


@dataclasses.dataclass
class Build:
    """What a runtime is built from, inside one worker."""

    ctx: WorkerContext
    layout: Layout
    model: nn.Module  #: on ctx.device, the same initial weights on every rank
    make_optimizer: OptimizerFactory
    loss_fn: LossFn
    steps: int  #: global steps in the whole run (a server says stop at it)
    accumulate: int = 1
    example: Optional[Batch] = None  #: one batch as this rank will see it (None: it reads no data)
    #: how long a peer may stay silent before it counts as hung (0: never), for strategies that drop one
    hang_timeout_s: float = 0.0
    precision: Precision = Precision()  #: autocast around each forward (and fp16's gradient scaler)
    clip_grad_norm: Optional[float] = None  #: the largest norm of the gradient an update applies (None: no clipping)
    #: the task's training step (not given: the model on a pair's inputs, then loss_fn, set in __post_init__)
    step: Step = None  # type: ignore[assignment]  # (a default made of another field: always a Step once built)

    def __post_init__(self) -> None:
        if self.step is None:
            self.step = DefaultStep(self.loss_fn)

    @property
    def plan(self) -> RankPlan:
        return self.layout.ranks[self.ctx.rank]


class SurvivorState(NamedTuple):
    """What a rank that survived a lost peer saves (:meth:`Runtime.survivor_state`)."""

    step: int  #: the step its state holds
    state: dict[str, Any]  #: as :meth:`Runtime.state_dict` returns it: the whole model
    note: str = ""  #: what the survivors did to it, for the run's log ("the survivors' replicas averaged")


@dataclasses.dataclass
class Report:
    """What a runtime adds to the metrics file (``fields``) and to what rank 0 prints (``lines``)."""

    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    lines: list[str] = dataclasses.field(default_factory=list)


class Runtime:
    """One rank's strategy at work: a data-parallel replica by default.

    ``model`` is what the user's code would call, ``optimizer`` the user's optimizer (both keep
    their interfaces); ``module`` is the bare model (checkpoints, evaluation); ``description`` is
    the phrase of the run header and ``notes`` its further lines (a pipeline's plan). The defaults run
    one replica per rank, reduce the loss and the
    evaluation counts over every rank, and save the model and optimizer as they are.
    """

    #: this rank's optimizer applies the updates (a parameter server's worker: no, its server's does), so
    #: the LR scheduler steps here
    steps_optimizer: ClassVar[bool] = True
    #: the ranks' batches are one batch each step (their gradients averaged before every update: sync, fsdp), so
    #: a loss averaged over tokens is weighed by every rank's tokens (see ``_token_shares``)
    one_batch: ClassVar[bool] = False
    _weighs_tokens: Optional[bool] = None  #: decided at the first step, the same on every rank (shapes, dtypes)

    def __init__(self, build: Build, model: Optional[nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, description: str = "",
                 notes: Sequence[str] = ()):
        self.build, self.ctx = build, build.ctx
        self.model = model if model is not None else build.model
        # The bare module (no DDP around it): a factory that takes the model finds its own names there.
        self.optimizer = optimizer if optimizer is not None else build.make_optimizer(self.module)
        self.description = description
        self.notes = list(notes)
        self.scaler = build.precision.scaler()  #: fp16 only (sync: checked in the parent)
        #: the norm of the last update's gradient before clipping, on the device (None: no clipping)
        self.grad_norm: Optional[torch.Tensor] = None

    @property
    def module(self) -> nn.Module:
        return self.model

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Inside it, backward passes accumulate locally without communicating."""
        return contextlib.nullcontext()

    def forward_backward(self, batch: Batch, y: Optional[torch.Tensor] = None,
                         parts: Optional[int] = None) -> torch.Tensor:
        """Gradients of the mean loss over the batch, in ``parts`` micro-batches (default: ``accumulate``).

        Returns the mean loss. Only the last micro-batch's backward communicates: the others run
        under ``no_sync``. The task's step (the forward and the loss) runs under the run's autocast (if any).
        ``batch``: any batch tree; ``forward_backward(x, y)`` is the pair ``(x, y)``.
        """
        batch = as_batch(batch, y)
        pieces = batches.split(batch, parts or self.build.accumulate)
        shares = self._token_shares(pieces)
        if len(pieces) == 1 and shares is None:  # (the common case, without the micro-batches' bookkeeping)
            return self._backward(batch, 1.0)
        size, losses = batches.length(batch), []
        for i, piece in enumerate(pieces):
            with self.no_sync() if i < len(pieces) - 1 else contextlib.nullcontext():
                losses.append(self._backward(piece, shares[i] if shares is not None else batches.length(piece) / size))
        return functools.reduce(operator.add, losses)

    def _token_shares(self, pieces: list[Batch]) -> Optional[list[torch.Tensor]]:
        """Where the ranks' batches are one batch (``one_batch``) and the loss is a mean over counted tokens
        (``-100`` left out): each piece's weight n · W / N, n its tokens and N the tokens of every rank's pieces
        (one small all-reduce), so that the gradients DDP or fsdp average over W ranks are those of the mean over
        all N tokens, as Hugging Face's Trainer does with ``average_tokens_across_devices``; a rank's mean alone
        weighs a rank with fewer tokens as much (Llama 1.4% in perplexity). None: the examples' shares do."""
        if self._weighs_tokens is None:
            self._weighs_tokens = (self.one_batch and self.ctx.distributed
                                   and averages_tokens(self.build.step, self.module, self.build.example))
        if not self._weighs_tokens:
            return None
        counts = torch.stack([counted_targets(self.build.step, self.module, piece) for piece in pieces]).float()
        total = counts.sum()
        dist.all_reduce(total)
        return list(counts * (self.ctx.world_size / total.clamp(min=1)))

    def _backward(self, batch: Batch, weight: Union[float, torch.Tensor]) -> torch.Tensor:
        """Backward of the step's loss on ``batch`` times ``weight`` (its share of the examples, or of the tokens
        across ranks: a tensor); that loss, detached."""
        with self.build.precision.autocast():
            loss = self.build.step(self.model, batch).loss
        weighted = isinstance(weight, torch.Tensor) or weight != 1.0  # (a tensor is not read on the host)
        scaled = loss * weight if weighted else loss  # (under autocast the loss is computed in fp32)
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return loss.detach() * weight if weighted else loss.detach()

    # ---- what the loop calls ----
    def train_step(self, batch: Batch, y: Optional[torch.Tensor] = None, parts: Optional[int] = None) -> torch.Tensor:
        """Forward, backward, one optimizer step; this rank's mean loss over its batch (detached).
        ``batch``: any batch tree (``train_step(x, y)``: the pair)."""
        loss = self.forward_backward(batch, y, parts)
        self.update()
        return loss

    def update(self) -> None:
        """The optimization step on the gradients backward left (reduced, where the strategy reduces them):
        unscaled (fp16), clipped (``--clip-grad-norm``), applied, cleared."""
        if self.build.clip_grad_norm is not None:
            if self.scaler is not None:  # the norm is the true gradient's, not the scaled one's
                self.scaler.unscale_(self.optimizer)
            self.clip_gradients()
        if self.scaler is not None:  # fp16: skip the step if a gradient overflowed, adapt the scale
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self) -> None:
        """torch's clip_grad_norm_, in its two halves, over the optimizer's parameters: the total norm of the
        gradient the update applies (:meth:`gradient_norm`), then every gradient scaled by max_norm / norm where
        that is below 1. No host read: the norm stays on the device (``grad_norm``) until a log step."""
        assert self.build.clip_grad_norm is not None, "called where the run clips (--clip-grad-norm)"
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.grad_norm = self.gradient_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, self.build.clip_grad_norm, self.grad_norm)

    def gradient_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of the whole model's gradient, given this rank's ``grads`` (every rank holds the whole
        gradient by default; a strategy that splits it overrides this)."""
        if not grads:
            return torch.zeros((), device=self.ctx.device)
        return torch.nn.utils.get_total_norm(grads)

    def next_step(self, step: int) -> Optional[int]:
        """The global step after this rank's train_step (None: this rank is done)."""
        return step + 1

    def global_losses(self, losses: torch.Tensor) -> torch.Tensor:
        """The mean over every rank of ``losses`` (this rank's loss at each step since the loop last
        looked), every rank getting the same values: one small all-reduce, at log steps only."""
        if not self.ctx.distributed:
            return losses
        out = losses.detach().clone()
        dist.all_reduce(out)
        return out / self.ctx.world_size

    def nonfinite_inputs(self, step: int) -> Optional[str]:
        """Where a runtime heard that the inputs of ``step`` held NaN or infinity (asked only once that
        step's loss was found non-finite), e.g. ``NaN (worker 2's batch)``; None: not known here (the
        loop then reads the batches of the step again itself where the ranks read them in step)."""
        return None

    def arrive_for_evaluation(self) -> None:
        """Wait until every rank has come to the evaluation that they run together. The loop calls it before it
        starts the evaluation's clock: the time a rank waits here for a slower one is lag that training built
        up (it would be waited at the next averaging or step all the same), so it counts as training time, as
        the simulation counts it. Without it a straggler's lead over the next meeting hid in evaluation time."""
        if self.ctx.distributed:
            dist.barrier()

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch], totals: Totals = COUNT_CORRECT) -> tuple[float, ...]:
        """The sums and counts of ``totals`` (see ``metrics.py``) over every rank's part of the test set,
        added over the ranks (a collective); by default (correct, total)."""
        sums = add_up(self.module, batches, self.ctx.device, totals, self.build.step)
        if self.ctx.distributed:
            sums = sums.to(self.ctx.device)
            dist.all_reduce(sums)
        return tuple(sums.tolist())

    def state_dict(self) -> Optional[dict[str, Any]]:
        """Model and optimizer state to save (called on every rank; rank 0's result is written)."""
        return Runtime.own_state(self)

    def own_state(self) -> dict[str, Any]:
        """This rank's own model and optimizer state, no collective (a survivor's save: :class:`SurvivorState`)."""
        scaler = {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(), **scaler}

    @property
    def writes_shards(self) -> bool:
        """Whether each rank saves its own shard of a checkpoint (:meth:`shard_state_dict`, written with torch's
        distributed checkpoint) instead of :meth:`state_dict`'s whole model from rank 0; such a runtime also
        loads a sharded checkpoint's shards itself (``state["shards"]``), where any other is given it whole."""
        return False

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's shards of the model and optimizer state (where :attr:`writes_shards`)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned by any strategy (on every rank). Without an
        ``"optimizer"`` entry the optimizer keeps its fresh state (the run changed optimizers)."""
        load_model_state(self.module, state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def survivor_state(self, step: int, survivors: Any) -> Optional[SurvivorState]:
        """After a peer was lost (a collective with it failed here, and the job's group is broken): the whole
        model's state as this rank holds it, made without that group, and the step it holds (``step``, the
        loop's last, or the one after where this step's update went in before its collective failed).
        ``survivors`` (``launcher/survivors.py``): the ranks that survived; its ``group()``, called by every one
        of them alike, joins them where they combine their replicas. None (the default): this rank holds a part
        of the model only, so nothing is saved (fsdp's shards, a pipeline's stage, a parameter server's worker).
        """
        return None

    def finish(self, stopping: bool = False) -> bool:
        """After the last step, before the final evaluation and checkpoint: whatever the strategy still
        owes the model (a last averaging, an outer round, the gradients in flight) goes into it here.
        Returns whether that changed the model, so that a checkpoint of this step written before is
        written again (ranks in step must all return the same: a checkpoint is a collective there).
        ``stopping``: a signal stopped the run, to be resumed: what is owed only to the run's end (local
        SGD's last averaging, DiLoCo's last outer round) stays owed, so the checkpoint holds the state
        a resume continues exactly (it holds the averaged model too: see ``replica_state.py``).

        By default every rank waits for the slowest, so that the measured training time (and
        throughput) covers every worker's steps, not only rank 0's; nothing changes.
        """
        if self.ctx.distributed:
            dist.barrier()
        return False

    def report(self, final: bool = False) -> Report:
        """Figures for the metrics file (``final``: the summary's, may be longer) and summary lines."""
        return Report()

    def close(self) -> None:
        """Release what the runtime took (threads, servers, shared memory)."""


def runtime_for(options: Options, ctx: WorkerContext, model: nn.Module, make_optimizer: Callable[[Any], Any],
                loss_fn: Optional[LossFn] = None, *, steps: int = 0, accumulate: int = 1,
                example: Optional[Batch] = None, clip_grad_norm: Optional[float] = None,
                training_step: Optional[Callable] = None) -> Runtime:
    """This rank's runtime for a loop of your own, inside a worker that :func:`phalanx.launch` started.

    The layout is computed here for ``ctx.world_size`` processes (every rank computes the same).
    ``make_optimizer``: ``params -> optimizer``, or ``model -> optimizer`` where its first parameter is
    named ``model``. ``training_step``: your ``step(model, batch) -> loss | (loss, outputs)`` (None:
    ``model(x)`` and ``loss_fn`` for a pair, ``model(**batch)`` and its own loss for a dict; see ``step.py``).
    """
    import functools

    import torch.nn.functional as F

    from ..task.step import step_for
    from ..task import call_optimizer_factory  # (the task layer: how a factory of the user's is called)

    loss_fn = loss_fn or F.cross_entropy
    job = Job((ctx.device,) * ctx.world_size, batches.length(example) if example is not None else None, accumulate,
              processes=ctx.world_size, model=model)
    build = Build(ctx, options.layout(job), model, functools.partial(call_optimizer_factory, make_optimizer),
                  loss_fn, steps, accumulate, example, clip_grad_norm=clip_grad_norm,
                  step=step_for(loss_fn, training_step))
    return options.runtime(build)


def as_batch(batch: Batch, y: Optional[torch.Tensor] = None) -> Batch:
    """``train_step(x, y)``, the form own loops were written in, is the pair ``(x, y)``."""
    return batch if y is None else (batch, y)


def nonfinite_values(batch: Batch) -> str:
    """"NaN" or "infinity" when a floating tensor of the batch holds them, else "" (a host read: for after a
    non-finite loss, never an ordinary step)."""
    return "" if batch is None else batches.nonfinite(batch)




def load_model_state(module: nn.Module, state: dict[str, Any]) -> None:
    try:
        module.load_state_dict(state)
    except RuntimeError as e:
        raise PhalanxError(
            f"checkpoint does not fit this model ({str(e).splitlines()[0][:160]}); "
            "resume with the --model and data the checkpoint was trained with"
        ) from None
