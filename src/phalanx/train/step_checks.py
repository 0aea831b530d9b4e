"""What the parent checks of a batch of any structure and of a training step (see ``step.py``): each bad input is
one line, exit 2, before any worker starts. The checks of a pair and the task's loss are ``checks.py``'s."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..data import batch as batches
from ..errors import PhalanxError
from ..task.metrics import Metric, Totals
from ..task.step import UserStep


def first_line_of_failure(call: Callable[[], Any], what: str, fix: str) -> Any:
    """``call()``, or its exception as one line: ``what (TypeError: ...); fix``."""
    try:
        return call()
    except PhalanxError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise PhalanxError(f"{what} ({type(e).__name__}: {first}); {fix}") from None


def check_step(model: nn.Module, batch: Any, step: Callable, loss_fn: Callable, metrics: Sequence[Metric]) -> None:
    """A batch of any other structure, or a training step of the user's: the step and the metrics tried once."""
    what = "the training step" if isinstance(step, UserStep) else "the model"
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            result = first_line_of_failure(lambda: step(model, batch), f"{what} fails on an example batch "
                                            f"{batches.describe(batch)}", "make it take the batches your data yields")
            check_loss(result.loss, what)
            if result.outputs is None and any(m.tally is not None for m in metrics):
                names = ", ".join(m.name for m in metrics if m.tally is not None)
                raise PhalanxError(f"the metrics {names} need the model's outputs, and {what} returns the loss alone; "
                                   "return (loss, outputs) from the training step, or --metric loss")
            if result.targets is None and any(m.tally is not None and not m.wants_batch for m in metrics):
                names = ", ".join(m.name for m in metrics if m.tally is not None)
                raise PhalanxError(f"the metrics {names} score outputs against targets, and the batch "
                                   f"{batches.describe(batch)} has none (a dict's labels or label, or --target-key); "
                                   "name the targets, or --metric loss")
            first_line_of_failure(lambda: Totals(metrics, loss_fn).add(result, batch),
                                   f"a metric ({', '.join(m.name for m in metrics)}) fails on the outputs "
                                   f"{batches.describe(result.outputs)}", "make it return (sum, count) for the batch")
    finally:
        model.train(was_training)


def check_loss(loss: Any, what: str) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise PhalanxError(f"{what} must give one number (a mean over the batch), as F.cross_entropy does")
