"""The training step: ``step(model, batch) -> StepResult(loss, outputs, targets)``, the model called as its authors
call it.

Every strategy's runtime, the evaluation and the parent's checks call a Task's step, never the model and the
loss themselves, so a model with keyword inputs and its own loss trains under every strategy unchanged.

:class:`DefaultStep`, by convention (Hugging Face's and torch's):

- a pair ``(x, y)``: ``model(x)``, scored with the task's loss on (logits, y); where the model's forward takes
  the targets second (``forward(idx, targets=None)``: a parameter named ``targets``, ``labels``, ``target`` or
  ``y``), ``model(x, y)`` as its own training script calls it (nanoGPT's and minGPT's ``model(X, Y)``), and the
  loss it returns is the loss (a ``(logits, loss)`` tuple, or an output's ``loss``);
- a dict: ``model(**batch)``; an output with a ``loss`` (an attribute or a key, as ``ModelOutput`` has) *is*
  the loss, else the task's loss on (logits, the dict's ``labels``/``label``/``--target-key``);
- logits for the metrics: the output itself, its ``.logits`` or ``["logits"]``, or a tuple's first element.

A causal language model of Hugging Face's (``*LMHeadModel``, ``*ForCausalLM``) shifts its labels inside its
loss (position t predicts token t+1); the metrics see the same shift (logits[:, :-1] against labels[:, 1:]),
so accuracy counts what the loss scored and ``perplexity`` = exp(the model's own loss) exactly.

:class:`UserStep` (``--training-step MODULE:CALLABLE``, ``Trainer(training_step=...)``, Lightning's word):
the user's ``step(model, batch) -> loss`` or ``-> (loss, outputs)``, used for training and, without gradients,
for evaluation.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..data import batch as batches
from ..errors import PhalanxError


@dataclasses.dataclass
class StepResult:
    loss: torch.Tensor  #: a scalar: the mean over the batch's counted targets (what backward starts from)
    outputs: Any = None  #: what the metrics score (logits), None where the step gave none
    targets: Any = None  #: what they score it against, None where the batch has none


def own_loss(out: Any) -> Optional[torch.Tensor]:
    """The loss a model computed itself (``ModelOutput.loss``, ``{"loss": ...}``), or None."""
    if type(out) is torch.Tensor:
        return None
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def logits_of(out: Any) -> Any:
    """What a model's output gives the metrics: itself, its ``logits``, or a tuple's first element."""
    if type(out) is torch.Tensor:
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, Mapping):
        logits = out.get("logits")
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    return out if logits is None else logits


def causal_lm(model: nn.Module) -> bool:
    """A Hugging Face causal language model (its loss shifts the labels by one position): a decoder-only
    config and a ``*LMHeadModel`` / ``*ForCausalLM`` class (a wrapper's ``module`` looked through)."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    return type(inner).__name__.endswith(("LMHeadModel", "ForCausalLM"))


def shifted(logits: Any, targets: Any) -> tuple[Any, Any]:
    """Position t's scores against token t+1, as a causal LM's own loss pairs them."""
    if isinstance(logits, torch.Tensor) and isinstance(targets, torch.Tensor) and targets.dim() > 1:
        return logits[:, :-1], targets[:, 1:]
    return logits, targets


@dataclasses.dataclass
class DefaultStep:
    """The model called as its authors call it (see the module docstring). Picklable: spawned workers get it."""

    loss_fn: Callable
    target_key: Optional[str] = None
    #: what is looked up once per model (by id): causal_lm(model) raises and catches AttributeErrors inside
    #: nn.Module, some microseconds a step (benchmarks/step_overhead.py); a signature, more
    _seen: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def __call__(self, model: nn.Module, batch: Any) -> StepResult:
        if batches.is_pair(batch):  # the fast path: phalanx's own form
            x, y = batch
            if self._takes_targets(model):
                return self._with_targets(model, x, y)
            out = model(x)
            if type(out) is torch.Tensor:
                return StepResult(self.loss_fn(out, y), out, y)
            logits = logits_of(out)
            loss = own_loss(out)
            return StepResult(self.loss_fn(logits, y) if loss is None else loss, logits, y)
        if type(batch) is dict or isinstance(batch, Mapping):
            return self._keywords(model, batch)
        raise PhalanxError(f"a batch {batches.describe(batch)} is neither a pair (inputs, targets) nor a dict of "
                           "keyword inputs; give --training-step MODULE:CALLABLE, a function step(model, batch) -> "
                           "loss that calls your model")

    def _takes_targets(self, model: nn.Module) -> bool:
        key = ("targets", id(model), type(model))
        found = self._seen.get(key)
        if found is None:
            found = self._seen[key] = targets_parameter(model) is not None
        return found

    def _with_targets(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> StepResult:
        """``model(x, y)``; its loss: an output's ``loss``, a one-number tensor a tuple holds after the logits
        (``(logits, loss)``), or the output itself where it is one number; else the task's loss on its logits."""
        out = model(x, y)
        if isinstance(out, torch.Tensor) and out.dim() == 0:
            return StepResult(out, None, y)
        logits, loss = logits_of(out), own_loss(out)
        if loss is None and isinstance(out, (tuple, list)):
            loss = next((t for t in out[1:] if isinstance(t, torch.Tensor) and t.dim() == 0), None)
        return StepResult(self.loss_fn(logits, y) if loss is None else loss, logits, y)

    def _keywords(self, model: nn.Module, batch: Mapping) -> StepResult:
        out = model(**self._renamed(model, batch) if "label" in batch else batch)
        y = batches.targets(batch, self.target_key)
        logits, loss = logits_of(out), own_loss(out)
        if loss is None:
            if y is None:
                raise PhalanxError(f"the model's output has no loss and the batch {batches.describe(batch)} no "
                                   "targets (labels, label, or the key --target-key names); return a loss from the "
                                   "model, name the targets, or give --training-step")
            loss = self.loss_fn(logits, y)
        else:
            key = ("causal", id(model), type(model))  # (the type too: a freed model's id may be reused)
            causal = self._seen.get(key)
            if causal is None:
                causal = self._seen[key] = causal_lm(model)
            if causal:
                logits, y = shifted(logits, y)
        return StepResult(loss, logits, y)

    def _renamed(self, model: nn.Module, batch: Mapping) -> Mapping:
        """A data set's ``label`` given as ``labels`` to a model that takes only that (as Hugging Face's data
        collators rename it), so a ``datasets`` column named ``label`` trains a ``*ForSequenceClassification``."""
        key = ("label", id(model), type(model))
        rename = self._seen.get(key)
        if rename is None:
            rename = self._seen[key] = takes(model, "labels") and not takes(model, "label")
        if not rename or "labels" in batch:
            return batch
        return {("labels" if k == "label" else k): v for k, v in batch.items()}


def takes(model: nn.Module, name: str) -> bool:
    """Whether the model's forward has a parameter ``name`` (a wrapper's ``module`` looked through)."""
    inner = getattr(model, "module", model)
    try:
        return name in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False


#: what a forward's second parameter is called where it takes the targets (nanoGPT, minGPT, Hugging Face, torch)
TARGET_NAMES = ("targets", "labels", "target", "y")


def targets_parameter(model: nn.Module) -> Optional[str]:
    """The name of the model's forward's second parameter where it is the targets' (``forward(idx,
    targets=None)``), else None (a wrapper's ``module`` looked through)."""
    inner = getattr(model, "module", model)
    try:
        parameters = inspect.signature(inner.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional[1] if len(positional) >= 2 and positional[1] in TARGET_NAMES else None


def calls_model_alone(step: Any, model: nn.Module) -> bool:
    """Whether ``step`` on a pair is ``model(x)`` and the task's loss on its output, so that a caller may run the
    model's forward itself (the simulation's one pass, a pipeline cut at blocks, the estimate's block timing)."""
    return isinstance(step, DefaultStep) and targets_parameter(model) is None


def averages_tokens(step: Any, model: nn.Module, example: Any) -> bool:
    """Whether ``step``'s loss is a mean over the batch's counted targets, one per position (a language model's,
    ``-100`` left out), which several ranks must weigh by their tokens to be one batch: the default step, targets
    per position of integers, and a loss that is torch's or Hugging Face's (not a model's that takes the targets
    itself, whose ignored value phalanx does not know: nanoGPT ignores -1)."""
    if not isinstance(step, DefaultStep) or example is None or targets_parameter(model) is not None:
        return False
    y = batches.targets(example, step.target_key)
    return isinstance(y, torch.Tensor) and y.dim() >= 2 and not y.is_floating_point()


def counted_targets(step: Callable, model: nn.Module, batch: Any) -> torch.Tensor:
    """How many targets of ``batch`` its loss averages over: those not ``-100`` (torch's and Hugging Face's
    ignore index), a causal LM's from the second position on (its loss shifts them)."""
    assert isinstance(step, DefaultStep), "asked only where averages_tokens holds: the default step"
    y = batches.targets(batch, step.target_key)
    assert isinstance(y, torch.Tensor), "asked only where averages_tokens holds: targets per position"
    if not batches.is_pair(batch) and causal_lm(model):
        y = shifted(y, y)[1]
    return (y != -100).sum()


@dataclasses.dataclass
class UserStep:
    """The user's ``step(model, batch) -> loss | (loss, outputs)`` as a step (targets: the batch's, by convention)."""

    fn: Callable
    target_key: Optional[str] = None

    def __call__(self, model: nn.Module, batch: Any) -> StepResult:
        made = self.fn(model, batch)
        outputs = None
        if isinstance(made, (tuple, list)) and len(made) == 2:
            made, outputs = made
        if not isinstance(made, torch.Tensor) or made.numel() != 1:
            name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
            got = tuple(made.shape) if isinstance(made, torch.Tensor) else type(made).__name__
            raise PhalanxError(f"the training step {name} returned {got}; return the loss (a one-number tensor, "
                               "the mean over the batch) or (loss, outputs)")
        return StepResult(made, None if outputs is None else logits_of(outputs),
                          batches.targets(batch, self.target_key))


def step_for(loss_fn: Callable, training_step: Optional[Callable] = None, target_key: Optional[str] = None):
    """The Task's step: the user's where given, else the convention's."""
    if training_step is not None:
        return UserStep(training_step, target_key)
    return DefaultStep(loss_fn, target_key)
