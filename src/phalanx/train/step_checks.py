"""What the parent checks of the model, its training step (see ``step.py``), its loss, its metrics and its optimizer
on an example batch of any structure: each bad input is one line, exit 2, before any worker starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..data import batch as batches
from ..errors import PhalanxError
from ..task import Task, label
from ..task.metrics import Metric, Totals
from ..task.step import DefaultStep, UserStep, calls_model_alone, logits_of, own_loss

if TYPE_CHECKING:
    from .checks import DataFacts


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


def check_model(model: nn.Module, facts: DataFacts, loss_fn: Callable, metrics: Sequence[Metric] = (),
                step: Optional[Callable] = None) -> None:
    """One forward pass, the loss and every metric on two examples, in the parent: shapes and classes
    (a classifier), or outputs that match the targets (a regression), or one clear line. ``step``: the task's
    (None: the convention's on a pair)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    step = step or DefaultStep(loss_fn)
    batch = batches.to_device(facts.example, device)
    if not (batches.is_pair(batch) and calls_model_alone(step, model)):
        return check_step(model, batch, step, loss_fn, metrics)
    x, y = batch
    regression = y.is_floating_point()
    was_training = model.training
    model.eval()  # eval: no BatchNorm statistics move, no dropout
    try:
        with torch.no_grad():
            made = first_line_of_failure(lambda: model(x), f"the model fails on an example batch of shape "
                                          f"{tuple(x.shape)}", f"make it accept inputs of shape (batch, "
                                          f"{', '.join(map(str, facts.input_shape))})")
            out = logits_of(made)
            if own_loss(made) is None:
                if regression:
                    _check_regression_outputs(out, y)
                else:
                    _check_class_scores(out, y, facts.num_classes)
            takes = "(outputs, float targets)" if regression else "(scores, integer labels)"
            with torch.enable_grad():  # as it trains: check_loss refuses a loss backward cannot start from
                result = first_line_of_failure(lambda: step(model, batch), f"loss_fn fails on the model's output "
                                                f"of shape {_shape(out)}", f"make it take {takes}")
            first_line_of_failure(lambda: Totals(metrics, loss_fn).add(result, batch),
                                   f"a metric ({', '.join(m.name for m in metrics)}) fails on the model's output "
                                   f"of shape {_shape(out)}", "make it return (sum, count) for the batch")
    finally:
        model.train(was_training)
    check_loss(result.loss, "loss_fn", model)


def _shape(out: Any) -> Any:
    return tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__


def _check_class_scores(out: Any, y: torch.Tensor, num_classes: int) -> None:
    """A classifier returns (batch, classes) scores; for a target per position (targets (batch, T)) a score
    per class and position, the classes last (batch, T, classes) or second (batch, classes, T)."""
    shape = _shape(out)
    if y.dim() > 1:
        last = isinstance(out, torch.Tensor) and out.dim() == y.dim() + 1 and tuple(out.shape[:-1]) == tuple(y.shape)
        second = isinstance(out, torch.Tensor) and out.dim() == y.dim() + 1 and \
            (out.shape[0],) + tuple(out.shape[2:]) == tuple(y.shape)
        if not (last or second):
            positions = ", ".join(map(str, y.shape[1:]))
            raise PhalanxError(f"the model returns {shape} for targets of shape {tuple(y.shape)}: a class per position "
                               f"needs a score per class and position; return (batch, {positions}, classes) (or "
                               f"(batch, classes, {positions}))")
        classes = out.shape[-1] if last else out.shape[1]
    elif not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise PhalanxError(f"the model returns {shape} for a batch of {len(y)}; integer targets make a classifier: "
                           "return scores of shape (batch, classes), or give float targets for a regression")
    else:
        classes = out.shape[1]
    if classes < num_classes:
        raise PhalanxError(f"the model outputs {classes} class scores but the labels go up to "
                           f"{num_classes - 1}; make its last layer output {num_classes}")


def _check_regression_outputs(out: Any, y: torch.Tensor) -> None:
    """A regression returns one value per target: shaped like the targets ((batch, 1) also for (batch,))."""
    if not isinstance(out, torch.Tensor) or out.numel() != y.numel():
        raise PhalanxError(f"the model returns {_shape(out)} for targets of shape {tuple(y.shape)}: float targets "
                           f"make a regression, so return one value per target (shape {tuple(y.shape)}, or "
                           f"{(len(y), 1)}); for classes give integer targets")


def check_optimizer(task: Task, model: nn.Module, steps: int = 1) -> None:
    """A user's optimizer and LR scheduler factories, tried once on the model in the parent: a failure is one
    line, before any worker starts (the workers call them again on their own replicas). The optimizer constructed
    here imports torch._dynamo, which a command given such a factory imports before its fork server forks
    (``cli._start_worker_server``)."""
    if task.make_optimizer is not None:
        first_line_of_failure(lambda: task.optimizer(model),
                               f"the optimizer factory {label(task.make_optimizer)} fails on the model",
                               "make it a callable params -> torch.optim.Optimizer, or model -> "
                               "torch.optim.Optimizer with its first parameter named model")
    if task.make_scheduler is not None:
        optimizer = task.optimizer(model) if task.make_optimizer is not None else \
            torch.optim.SGD(model.parameters(), lr=0.1)
        first_line_of_failure(lambda: task.scheduler(optimizer, steps),
                               f"the LR scheduler factory {label(task.make_scheduler)} fails on the optimizer",
                               "make it a callable optimizer -> torch.optim.lr_scheduler.LRScheduler (it may take "
                               "total_steps=)")
