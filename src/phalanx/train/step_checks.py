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
            with torch.enable_grad():  # as it trains: a loss backward cannot start from is refused here
                result = first_line_of_failure(lambda: step(model, batch), f"{what} fails on an example batch "
                                               f"{batches.describe(batch)}", "make it take the batches your data "
                                               "yields")
            check_loss(result.loss, what, model)
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


def check_loss(loss: Any, what: str, model: nn.Module) -> None:
    """One number that backward can start from: a floating tensor with a gradient (where anything trains), computed
    with gradients enabled. A detached or integer loss failed in every worker's first backward, a 30-line traceback."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise PhalanxError(f"{what} must give one number (a mean over the batch), as F.cross_entropy does")
    if not (loss.is_floating_point() or loss.is_complex()):
        raise PhalanxError(f"{what} gives a loss of dtype {str(loss.dtype).replace('torch.', '')}, which has no "
                           "gradient: give a floating-point loss computed from the model's outputs (a mean over the "
                           "batch, as F.cross_entropy gives)")
    if not loss.requires_grad and any(p.requires_grad for p in model.parameters()):
        raise PhalanxError(f"{what} gives a loss with no gradient (detached from the model: .detach(), .item(), "
                           "torch.no_grad() or a new tensor made from it): give the loss as computed from the model's "
                           "outputs, so that backward reaches the parameters")
