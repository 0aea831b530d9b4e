"""Calling the user's factories as their authors wrote them: a model factory, a model object, an optimizer factory.

A factory gets what it names (``num_classes``, ``input_shape``, ``model``) in the ecosystem's
conventions; a model object given to the API is copied for every worker. What fails is one line
naming the fix, not a TypeError deep in a worker.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..errors import PhalanxError
from .import_paths import first_line


def names_parameter(fn: Callable, name: str, first: bool = False) -> bool:
    """Whether ``fn``'s signature names a parameter ``name`` (``first``: as its first one)."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return (params[:1] == [name]) if first else name in params


def call_optimizer_factory(factory: Callable, model: Any) -> torch.optim.Optimizer:
    """``factory(model)`` where its first parameter is named ``model`` (``def opt(model): return
    model.configure_optimizers(...)``: parameter groups by name are the user's rule), else
    ``factory(model.parameters())`` as torch's optimizers take them. ``model`` is the module the
    strategy steps (see docs/strategies.md); parameters given instead are passed as they are."""
    if not isinstance(model, nn.Module):
        return factory(model)
    return factory(model) if names_parameter(factory, "model", first=True) else factory(model.parameters())


def call_model_factory(factory: Callable, name: str, input_shape: tuple, num_classes: int) -> nn.Module:
    """Call an imported model factory with what it can take, in the ecosystem's conventions: ``num_classes``
    where a parameter is so named or through ``**kwargs`` (torchvision's builders pass it on to the model's
    constructor), ``input_shape`` only where a parameter is so named (no constructor of the ecosystem takes it)."""
    try:
        params: Mapping[str, inspect.Parameter] = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_more = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {}
    if "input_shape" in params:
        kwargs["input_shape"] = tuple(input_shape)
    if "num_classes" in params or takes_more:
        kwargs["num_classes"] = num_classes
    try:
        model = factory(**kwargs)
    except Exception as e:
        raise PhalanxError(f"--model {name}: calling it with {kwargs or 'no arguments'} failed "
                           f"({type(e).__name__}: {first_line(e)}); phalanx passes num_classes (named, or through "
                           "**kwargs) and input_shape (named) only; wrap other arguments in a function of yours") \
            from None
    if not isinstance(model, nn.Module):
        raise PhalanxError(f"--model {name}: returned {type(model).__name__}; expected a torch.nn.Module")
    return model


def copy_of(model: nn.Module, input_shape: tuple, num_classes: int) -> nn.Module:
    """The factory of a model object given to the API: every worker trains a copy of it."""
    try:
        return copy.deepcopy(model)
    except Exception as e:  # a lock, an open file, a thread: whatever the user's module holds
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise PhalanxError(f"the model cannot be copied for the workers ({type(e).__name__}: {first}"
                           f"{_culprit(model)}); every worker trains its own copy of the model object: give its class "
                           "a __getstate__ and __setstate__ that leave that attribute out and make it anew, or name "
                           "a factory instead, TrainConfig(model='mymodule:Net')") from None


def _culprit(model: nn.Module) -> str:
    """`` in attribute 'encoder.lock'``: the first attribute of a submodule that cannot be copied ("" if none alone)."""
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if name.startswith("_") or isinstance(value, (nn.Module, torch.Tensor)):
                continue  # parameters, buffers and submodules live in underscored dicts, walked as modules
            try:
                copy.deepcopy(value)
            except Exception:
                return f" in attribute '{prefix + '.' if prefix else ''}{name}'"
    return ""
