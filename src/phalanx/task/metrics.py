"""What an evaluation reports, exactly over every rank, and which way is better; and targets to stop at.

A metric is a function ``(outputs, targets) -> (sum, count)`` over one batch: its value on a whole
set is the sum of the sums over the sum of the counts. Ranks each evaluate their part of the test
set and add their vectors of sums and counts (one all-reduce), so the value over 2 or 64 ranks is
the single-process value on the whole set, never an average of per-rank averages (which weighs a
rank's smaller last batch as much as a full one).

Built-in metrics, by name (``--metric NAME``):

- ``accuracy`` (higher is better): the fraction of targets whose class has the highest score
  (outputs ``(N, C)``, or ``(N, T, C)`` / ``(N, C, T)`` for a target per position); targets of ``-100``
  (torch's ``ignore_index``, Hugging Face's padding) are left out;
- ``loss`` (lower is better): the step's own loss (the model's, where it computes one: ``step.py``), taken as
  a mean over the targets it counted (torch's ``reduction="mean"``, ``-100`` left out), so a batch adds
  ``loss x counted targets``;
- ``perplexity`` (lower is better): ``exp`` of that loss over the whole set: with the default loss
  (:func:`cross_entropy`, a mean over tokens) exp of the mean loss per token, a language model's; reported
  by default where the targets are one class per position (targets (N, T));
- ``mse``, ``rmse``, ``mae`` (lower is better): squared, root-mean-squared and absolute errors.

A metric of your own (``--metric mymetrics:f1`` or ``Trainer(metrics=[f1])``): a module-level
function ``fn(outputs, targets) -> (sum, count)`` returning this batch's sum of per-example (or
per-element) values and how many it summed, as numbers or one-element tensors; ``fn(outputs, batch)``,
its second parameter named ``batch``, receives the whole batch; its name is the
function's name and lower is better unless it has an attribute ``higher_is_better = True``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..data.batch import IGNORE, counted
from ..errors import PhalanxError

Tally = Callable[[torch.Tensor, torch.Tensor], tuple[Any, Any]]


@dataclasses.dataclass(frozen=True)
class Metric:
    """A number the evaluation reports, which way is better, and how a batch adds to it."""

    name: str
    higher_is_better: bool
    tally: Optional[Tally] = None  #: (outputs, targets) -> (sum, count); None: the run's loss
    finish: Optional[Callable[[float], float]] = None  #: applied to sum / count (perplexity: exp)
    wants_batch: bool = False  #: the tally takes (outputs, batch): its second parameter is named ``batch``

    def value(self, total: float, count: float) -> float:
        mean = total / count if count else math.nan
        return self.finish(mean) if self.finish is not None and math.isfinite(mean) else mean


# --------------------------------------------------------------------------- the built-in metrics


def _predicted(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The class with the highest score, per target: scores last (N, T, C) or second (N, C) / (N, C, T)."""
    if outputs.dim() == targets.dim() + 1 and tuple(outputs.shape[:-1]) == tuple(targets.shape):
        return outputs.argmax(-1)
    return outputs.argmax(1)


def correct(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int | torch.Tensor]:
    """Targets of ``-100`` (torch's ``ignore_index``, Hugging Face's padding) are no class: left out."""
    hits = _predicted(outputs, targets) == targets
    if targets.is_floating_point() or not bool((targets == IGNORE).any()):
        return hits.sum(), targets.numel()
    kept = targets != IGNORE
    return (hits & kept).sum(), kept.sum()


def _aligned(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Outputs in the targets' shape where only a trailing 1 differs ((N, 1) against (N,)): broadcasting
    those two would compare every output with every target, silently."""
    if outputs.shape != targets.shape and outputs.numel() == targets.numel():
        return outputs.reshape(targets.shape)
    return outputs


def squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[Any, int]:
    return (_aligned(outputs, targets) - targets).double().pow(2).sum(), targets.numel()


def absolute_error(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[Any, int]:
    return (_aligned(outputs, targets) - targets).double().abs().sum(), targets.numel()


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The default loss for integer targets: ``F.cross_entropy``, and for a target per position with the
    scores last (outputs (N, T, C), targets (N, T), as a language model's head gives them) the mean over
    every token. ``F.cross_entropy`` wants the classes second ((N, C, T)); read as that, (N, T, C) either
    fails or, where T equals C, silently scores the wrong axis. Scores last win where both fit, as in
    :func:`correct`."""
    if targets.dim() > 1 and tuple(outputs.shape[:-1]) == tuple(targets.shape):
        return F.cross_entropy(outputs.flatten(0, -2), targets.flatten())
    return F.cross_entropy(outputs, targets)


def mse_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The default loss for float targets: mean squared error, outputs (N, 1) taken as (N,) when the
    targets are (N,) (``F.mse_loss`` would broadcast them to (N, N) with only a warning)."""
    return F.mse_loss(_aligned(outputs, targets), targets)


ACCURACY = Metric("accuracy", True, correct)
LOSS = Metric("loss", False)
PERPLEXITY = Metric("perplexity", False, None, math.exp)
MSE = Metric("mse", False, squared_error)
RMSE = Metric("rmse", False, squared_error, math.sqrt)
MAE = Metric("mae", False, absolute_error)
BUILT_IN = {m.name: m for m in (ACCURACY, LOSS, PERPLEXITY, MSE, RMSE, MAE)}

#: What is reported when no metric is named: classifiers (integer targets), sequence models (integer
#: targets per position: a language model's perplexity), regression (float targets).
CLASSIFICATION, SEQUENCE, REGRESSION = (ACCURACY, LOSS), (PERPLEXITY, ACCURACY, LOSS), (LOSS, MSE)


def user_metric(fn: Callable, name: Optional[str] = None) -> Metric:
    """A function ``(outputs, targets) -> (sum, count)`` as a Metric (see the module docstring); one whose
    second parameter is named ``batch`` receives the whole batch instead of its targets."""
    name = name or getattr(fn, "__name__", None) or type(fn).__name__
    higher = getattr(fn, "higher_is_better", False)
    if not isinstance(higher, bool):
        raise PhalanxError(f"metric {name}: higher_is_better is {higher!r}; set it to True or False")
    return Metric(name, higher, fn, wants_batch=_second_parameter(fn) == "batch")


def _second_parameter(fn: Callable) -> Optional[str]:
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names[1] if len(names) > 1 else None


def with_loss(metrics: Sequence[Metric]) -> tuple[Metric, ...]:
    """The metrics asked for, and the loss after them: an evaluation always reports the loss."""
    metrics = tuple(metrics)
    return metrics if any(m.name == "loss" for m in metrics) else metrics + (LOSS,)


# --------------------------------------------------------------------------- adding up batches


class Totals:
    """Per batch, the float64 vector [sum, count] of the loss (where a metric is made of it) and of
    every other metric: the vector a rank adds to, and the ranks add together (one all-reduce).

    The loss is the step's own (the model's where it computes one), weighted by the targets it averaged
    over (``-100`` left out), so the loss over a set is exact however it was cut into batches."""

    def __init__(self, metrics: Sequence[Metric], loss_fn: Optional[Callable] = None):
        self.metrics = tuple(metrics)
        self.with_loss = any(m.tally is None for m in self.metrics)
        self.loss_fn = loss_fn if self.with_loss else None  #: for outputs given without the step's loss
        self.tallies = [m for m in self.metrics if m.tally is not None]
        self.size = 2 * (len(self.tallies) + self.with_loss)

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float64)

    def __call__(self, outputs: Any, targets: Any, loss: Optional[torch.Tensor] = None, batch: Any = None
                 ) -> torch.Tensor:
        """This batch's vector; ``loss``: the step's (None: the loss_fn on outputs and targets)."""
        if not self.size:
            return self.zeros()
        if isinstance(targets, torch.Tensor) and isinstance(outputs, torch.Tensor):
            targets = targets.to(outputs.device)
        pairs: list[Sequence[Any]] = []
        if self.with_loss:
            if loss is None:
                assert self.loss_fn is not None, "a Totals with the loss is given the step's loss or a loss_fn"
                loss = self.loss_fn(outputs, targets)
            n = counted(targets) if targets is not None else _examples(batch)
            pairs.append((loss.detach().double() * n, n))
        for metric in self.tallies:
            assert metric.tally is not None  # (the tallies are the metrics that have one)
            made = metric.tally(outputs, batch if metric.wants_batch else targets)
            if not isinstance(made, (tuple, list)) or len(made) != 2:
                raise PhalanxError(f"metric {metric.name} returned {type(made).__name__}; a metric returns (sum, "
                                   "count) for the batch, e.g. (errors.sum(), len(targets))")
            pairs.append(made)
        return torch.tensor([float(v) for pair in pairs for v in pair], dtype=torch.float64)

    def add(self, result: Any, batch: Any) -> torch.Tensor:
        """This batch's vector from a step's :class:`~phalanx.task.step.StepResult`."""
        if not self.size:
            return self.zeros()
        return self(result.outputs, result.targets, result.loss, batch)

    def values(self, sums: Sequence[float]) -> dict[str, float]:
        """Each metric's value from the summed vector, in the metrics' order."""
        out, at = {}, 2 if self.with_loss else 0
        for m in self.metrics:
            if m.tally is None:
                out[m.name] = m.value(sums[0], sums[1])
            else:
                out[m.name] = m.value(sums[at], sums[at + 1])
                at += 2
        return out


def _examples(batch: Any) -> int:
    from ..data.batch import length

    return length(batch) if batch is not None else 1


#: Adds nothing: forwards whose outputs are not counted (a rank keeping in step with the others).
FORWARD_ONLY = Totals(())


def add_up(model: torch.nn.Module, batches: Iterable, device: torch.device, totals: Totals,
           step: Optional[Callable] = None) -> torch.Tensor:
    """``totals`` summed over ``batches`` of ``step(model, batch)`` (in eval mode, no gradients); ``step``: the
    task's (None: the model called on a pair's inputs, scored with ``totals``' loss)."""
    from ..data.batch import to_device
    from .step import DefaultStep

    step = step or DefaultStep(totals.loss_fn or cross_entropy)
    was_training = model.training
    model.eval()
    sums = totals.zeros()
    try:
        with torch.no_grad():
            for batch in batches:
                batch = to_device(batch, device)
                sums += totals.add(step(model, batch), batch)
    finally:
        model.train(was_training)
    return sums


def said(values: dict[str, float]) -> str:
    """``accuracy 0.9722, loss 0.0912``."""
    return ", ".join(f"{name} {value:.4f}" for name, value in values.items())


# --------------------------------------------------------------------------- targets


@dataclasses.dataclass(frozen=True)
class Target:
    """A value of one metric to reach: ``accuracy>=0.95``, ``loss<=0.30``."""

    metric: str
    higher: bool  #: reached going up (>=) or down (<=)
    value: float

    def reached(self, values: dict[str, float]) -> bool:
        got = values.get(self.metric, math.nan)
        return got >= self.value if self.higher else got <= self.value

    def __str__(self) -> str:
        return f"{self.metric}{'>=' if self.higher else '<='}{self.value:g}"


_TARGET = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(>=|<=)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
_EXAMPLES = "e.g. accuracy>=0.95, loss<=0.30 or perplexity<=5 (a bare number means accuracy)"


def parse_target(text: Any, flag: str = "--stop-at") -> Target:
    """A target from its text; a bare number (or a float) is an accuracy."""
    if isinstance(text, Target):
        return text
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = repr(float(text))
    if not isinstance(text, str):
        raise PhalanxError(f"{flag} {text!r}: write METRIC>=VALUE or METRIC<=VALUE, {_EXAMPLES}")
    try:
        target = Target("accuracy", True, float(text))
    except ValueError:
        found = _TARGET.match(text)
        if not found:
            raise PhalanxError(f"{flag} {text}: write METRIC>=VALUE or METRIC<=VALUE, {_EXAMPLES}") from None
        target = Target(found.group(1), found.group(2) == ">=", float(found.group(3)))
    if target.metric == "accuracy" and not 0 < target.value <= 1:
        raise PhalanxError(f"{flag} {text}: an accuracy is in (0, 1], e.g. accuracy>=0.95")
    return target


def check_target(target: Target, metrics: Sequence[Metric], flag: str = "--stop-at") -> None:
    """The target names a reported metric and goes its better way; else one line naming the fix."""
    metric = next((m for m in metrics if m.name == target.metric), None)
    if metric is None:
        names = ", ".join(m.name for m in metrics)
        raise PhalanxError(f"{flag} {target}: no metric is named {target.metric} (this run reports {names}); "
                           f"name a built-in one ({', '.join(BUILT_IN)}) or add --metric MODULE:{target.metric}")
    if metric.higher_is_better != target.higher:
        better, op = ("higher", ">=") if metric.higher_is_better else ("lower", "<=")
        fix = "" if metric.name in BUILT_IN else \
            f" (or give {metric.name} higher_is_better = {not metric.higher_is_better})"
        raise PhalanxError(f"{flag} {target}: a {better} {metric.name} is better, so its target is reached going "
                           f"{'up' if metric.higher_is_better else 'down'}: write {metric.name}{op}{target.value:g}"
                           f"{fix}")
