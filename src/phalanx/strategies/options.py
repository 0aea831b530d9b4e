"""The base of every strategy's options: a frozen dataclass whose fields are the strategy's flags, and what the
strategy can do, asked by the code around the strategies instead of naming one (see :mod:`.base` for the shape of a
strategy: options, a layout, a runtime)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from torch import nn

from ..errors import PhalanxError
from ..task.models import model_units
from .layout import Job, Layout, data_parallel

if TYPE_CHECKING:
    from .base import Build, Runtime


@dataclasses.dataclass(frozen=True)
class Options:
    """Base of every strategy's options. Subclasses declare fields with ``option(...)``."""

    name: ClassVar[str] = "base"
    #: one line for ``--strategy`` help and the README
    summary: ClassVar[str] = ""
    # What it can do, for the code around the strategies, which asks instead of naming one (docs/architecture.md,
    # "How the code reads"):
    #: compare's ratios are taken against it where a comparison runs it: the plain data parallelism the
    #: others depart from
    reference: ClassVar[bool] = False
    #: --precision fp16's gradient scaler can run: every replica steps its optimizer once per step, so a step
    #: the scaler skips is skipped on every replica alike
    fp16_scaler: ClassVar[bool] = False
    #: its workers share one machine's CPU memory, so it runs on CPU devices only (compare leaves it out on GPUs)
    cpu_only: ClassVar[bool] = False
    #: on 2+ workers each rank saves its own shard of a checkpoint (torch's distributed checkpoint), so
    #: --async-checkpoint can write it in the background
    sharded_checkpoints: ClassVar[bool] = False
    #: phalanx estimate times it on batches (inputs, targets) run through the model's own blocks (a pipeline's
    #: stages), so a task of other batches or a step of the user's is not predicted (train runs it all the same)
    estimated_on_pairs: ClassVar[bool] = False
    #: --activation-checkpointing can wrap the model's blocks before its runtime does: its workers run the
    #: model's forward and backward as written (no engine of its own traces or splits the model)
    checkpoints_activations: ClassVar[bool] = False
    #: its ranks run the model as one piece and communicate only after backward, never inside it, so --compile
    #: compiles the model whole (see :meth:`compiles_whole`)
    one_piece_backward: ClassVar[bool] = False
    #: every rank holds the whole model, so when a worker dies the survivors save it at the step they hold
    #: (:meth:`Runtime.survivor_state`), and the launcher waits for them before it restarts the job
    survivors_save: ClassVar[bool] = False

    def layout(self, job: Job) -> Layout:
        """Pure: the processes of the job (raise PhalanxError for a job this strategy cannot run)."""
        return data_parallel(job)

    def runtime(self, build: "Build") -> "Runtime":
        """Built inside each worker."""
        raise NotImplementedError

    def describe(self) -> str:
        """How the run header names this strategy."""
        return self.name

    def units(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The model's blocks as this strategy sees them (``--activation-checkpointing`` recomputes each)."""
        return model_units(model)

    def compiles_whole(self, world_size: int) -> bool:
        """Whether ``--compile`` compiles the model whole, as a user's ``torch.compile(model)`` does (inductor then
        fuses across blocks and into the loss): each rank runs the model as one piece, and nothing communicates
        while its backward runs. Else each block is compiled alone: DDP's buckets reduce during backward, fsdp
        gathers a unit at a time, a pipeline splits at blocks."""
        return self.one_piece_backward

    def rehearse(self, model: nn.Module, example: Any, step: Callable) -> None:
        """In the parent, before any worker starts: run what a first step of this strategy runs that the model
        alone does not (a split forward, a tensor-parallel plan applied), on a copy of ``model`` with the example
        batch, where that is cheap; a failure is one line naming the feature and the fix (PhalanxError)."""

    def builds_on_meta(self) -> bool:
        """Whether every worker builds the model on the meta device (nothing allocated) and the runtime
        materialises it (only its own shards: ``--init-device meta``); else it is built on the worker's device."""
        return False

    def _set(self, **values: Any) -> None:
        """Normalise a field in ``__post_init__`` (the dataclass is frozen)."""
        for key, value in values.items():
            object.__setattr__(self, key, value)


def require_positive(flag: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PhalanxError(f"{flag} must be a positive integer, got {value!r}")
