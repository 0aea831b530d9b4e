"""The user's problem as one object: model factory, data, loss, metrics, optimizer factory.

A :class:`Task` is built once, in the parent, from the config's names (built-in ``cnn``, or an
import path ``mymodels:Net`` as uvicorn and gunicorn spell them) and from what the API was given
(a model object, datasets, a loss, an optimizer factory). Everything downstream (the checks, the
plan, the workers' loop, the checkpoints) reads the Task and never asks whether a part is built in.

Spawned workers receive the Task by pickling: functions and classes travel by reference (module
and name), so the module of an import path must be importable there too; :func:`importable_cwd`
puts the current directory on the path of this process and of every process it starts.

Here: the Task and how a run's Task is built. Import paths are resolved in ``import_paths.py``; the
user's factories are called in ``factories.py``; the training step is ``step.py``'s, the metrics
``metrics.py``'s, the built-in models ``models.py``'s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..data import DataBundle
from ..errors import PhalanxError
from .factories import call_model_factory, call_optimizer_factory, copy_of, names_parameter
from .import_paths import importable_cwd, is_import_path, label, resolve
from .metrics import (BUILT_IN, CLASSIFICATION, REGRESSION, SEQUENCE, Metric, check_target, cross_entropy, mse_loss,
                      user_metric, with_loss)
from .models import build_model
from .step import step_for


OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
#: ``(optimizer) -> scheduler``, or ``(optimizer, total_steps=...)`` where it names total_steps
SchedulerFactory = Callable[..., Any]


@dataclasses.dataclass
class Task:
    """The user's problem. ``make_model(input_shape, num_classes)`` builds the model (every worker
    calls it after seeding, so every replica starts equal); ``make_optimizer`` None: the config's
    built-in optimizer by name (sgd, adam, adamw), with its lr schedule and batch scaling;
    ``make_scheduler`` None: phalanx's own schedule (``--lr-schedule``)."""

    make_model: Callable[[tuple, int], nn.Module]
    model_name: str  #: how the header and the checkpoint name the model: ``cnn``, ``mymodels:Net``
    data: Optional[DataBundle] = None  #: train and test sets in memory (None: a built-in set each worker loads)
    data_name: str = "digits"  #: how the header and the checkpoint name the data
    loss_fn: Callable = cross_entropy  #: token-level for a target per position (see metrics.py)
    #: what evaluation reports (the loss always among them), each with its direction (see metrics.py)
    metrics: tuple[Metric, ...] = CLASSIFICATION
    make_optimizer: Optional[OptimizerFactory] = None
    make_scheduler: Optional[SchedulerFactory] = None
    #: the user's ``step(model, batch) -> loss | (loss, outputs)`` (None: the convention's, see step.py)
    training_step: Optional[Callable] = None
    target_key: Optional[str] = None  #: the key of a dict batch holding the targets (None: labels or label)

    @property
    def step(self) -> Callable:
        """``step(model, batch) -> StepResult``: how every strategy, the evaluation and the checks call the model."""
        return step_for(self.loss_fn, self.training_step, self.target_key)

    def optimizer(self, model: Any) -> torch.optim.Optimizer:
        """The factory's optimizer on ``model`` (a module: see :func:`call_optimizer_factory`), checked: a
        factory returning something else is one line."""
        assert self.make_optimizer is not None, "asked only of a task with an optimizer factory"
        made = call_optimizer_factory(self.make_optimizer, model)
        if not isinstance(made, torch.optim.Optimizer):
            raise PhalanxError(f"the optimizer factory {label(self.make_optimizer)} returned "
                               f"{type(made).__name__}; expected a torch.optim.Optimizer built on the params given")
        return made

    def scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        """The user's LR scheduler on ``optimizer``, checked: something without ``step`` and ``state_dict``
        (what the loop and checkpoints use) is one line."""
        factory = self.make_scheduler
        assert factory is not None, "asked only of a task with a scheduler factory"
        made = factory(optimizer, total_steps=total_steps) if names_parameter(factory, "total_steps") \
            else factory(optimizer)
        if not all(callable(getattr(made, m, None)) for m in ("step", "state_dict", "load_state_dict")):
            raise PhalanxError(f"the LR scheduler factory {label(factory)} returned {type(made).__name__}; expected a "
                               "torch.optim.lr_scheduler scheduler built on the optimizer given")
        return made

    def optimizer_for(self, cfg: Any, model: Any, global_batch: Optional[int] = None) -> torch.optim.Optimizer:
        """The run's optimizer on ``model`` (a module, or its parameters): the user's factory (its own lr: a
        schedule multiplies it), else the config's ``--optimizer`` at ``--lr``, scaled to ``global_batch`` by
        the linear scaling rule (None: as given)."""
        if self.make_optimizer is not None:
            return self.optimizer(model)
        params = model.parameters() if isinstance(model, nn.Module) else model
        from .schedules import scaled_lr

        lr = cfg.lr if global_batch is None else scaled_lr(cfg.lr, global_batch, cfg.lr_base_batch)
        if cfg.optimizer in ("adam", "adamw"):  # AdamW: decoupled weight decay (Loshchilov & Hutter)
            make = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
            return make(params, lr=lr, weight_decay=cfg.weight_decay)
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


# --------------------------------------------------------------------------- building a Task


def task_from(cfg: Any, *, model: Optional[Any] = None, train_data: Any = None, test_data: Any = None,
              loss_fn: Optional[Callable] = None, optimizer: Optional[OptimizerFactory] = None,
              metrics: Optional[Sequence[Any]] = None, target_flag: str = "--stop-at",
              lr_scheduler: Optional[SchedulerFactory] = None, training_step: Optional[Callable] = None) -> Task:
    """The Task of a run (``cfg``: its TrainConfig): what the API was given first, else the config's
    names (built-in, or import paths resolved here, in the parent, so that nothing starts if one fails).
    Float targets make a regression: MSE unless a loss is given, and loss and mse reported; integer targets
    per position (N, T) a sequence model: perplexity, accuracy per token and the loss reported.
    ``target_flag``: how an error about ``cfg``'s target names it (compare's is ``--target``)."""
    if optimizer is not None and cfg.optimizer is not None:
        raise PhalanxError(f"optimizer= and --optimizer {cfg.optimizer} both name the optimizer: give one")
    if metrics is not None and cfg.metric is not None:
        raise PhalanxError(f"metrics= and --metric {cfg.metric} both name the metrics: give one")
    if lr_scheduler is not None and cfg.lr_scheduler is not None:
        raise PhalanxError(f"lr_scheduler= and --lr-scheduler {cfg.lr_scheduler} both name the LR scheduler: give one")
    target_key = getattr(cfg, "target_key", None)
    data, data_name = _task_data(cfg, train_data, test_data, target_key)
    regression = data is not None and data.train.target_dtype.is_floating_point
    sequence = data is not None and not regression and len(data.train.target_shape) > 0
    task = _task_parts(cfg.model, cfg.optimizer, cfg.loss, model, loss_fn, optimizer, regression)
    task.data, task.data_name = data, data_name
    task.training_step, task.target_key = _training_step(cfg, training_step), target_key
    task.metrics = _metrics(cfg, metrics, regression, sequence, target_flag)
    task.make_scheduler = lr_scheduler if lr_scheduler is not None else resolve(
        cfg.lr_scheduler, "--lr-scheduler", "a callable optimizer -> LR scheduler") if cfg.lr_scheduler else None
    return task


def user_task(cfg: Any, *, model: Optional[Any] = None, train_data: Any = None, test_data: Any = None,
              loss_fn: Optional[Callable] = None, optimizer: Optional[OptimizerFactory] = None,
              metrics: Optional[Sequence[Any]] = None, target_flag: str = "--stop-at",
              lr_scheduler: Optional[SchedulerFactory] = None, training_step: Optional[Callable] = None) -> Task:
    """:func:`task_from` for what a Python caller passed (``Trainer``, ``phalanx.compare``,
    ``phalanx.estimate``): a wrong kind of object is one line here, not a TypeError deep in a worker."""
    if model is not None and not isinstance(model, nn.Module) and not callable(model):
        raise PhalanxError(f"model must be a torch.nn.Module or a factory that returns one (e.g. "
                           f"functools.partial(Net, config)), got {type(model).__name__}")
    if optimizer is not None and not callable(optimizer):
        raise PhalanxError(f"optimizer must be a callable params -> torch.optim.Optimizer, got "
                           f"{type(optimizer).__name__}")
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise PhalanxError(f"lr_scheduler must be a callable optimizer -> LR scheduler, got "
                           f"{type(lr_scheduler).__name__}")
    if training_step is not None and not callable(training_step):
        raise PhalanxError(f"training_step must be a callable step(model, batch) -> loss, got "
                           f"{type(training_step).__name__}")
    return task_from(cfg, model=model, train_data=train_data, test_data=test_data, loss_fn=loss_fn,
                     optimizer=optimizer, metrics=metrics, target_flag=target_flag, lr_scheduler=lr_scheduler,
                     training_step=training_step)


def _training_step(cfg: Any, given: Optional[Callable]) -> Optional[Callable]:
    """``training_step=`` or ``--training-step MODULE:CALLABLE`` (not both)."""
    spec = getattr(cfg, "training_step", None)
    if given is not None and spec is not None:
        raise PhalanxError(f"training_step= and --training-step {spec} both name the training step: give one")
    if spec is None:
        return given
    return resolve(spec, "--training-step", "a step(model, batch) -> loss or (loss, outputs)")


def named_optimizer(cfg: Any, task: Task) -> Any:
    """The config with the optimizer and scheduler factories' names (``mymodels:adamw``) where the API gave
    the factories: the header, the checkpoint's settings and ``--resume`` name them."""
    if task.make_optimizer is not None and cfg.optimizer is None:
        cfg = dataclasses.replace(cfg, optimizer=label(task.make_optimizer))
    if task.make_scheduler is not None and cfg.lr_scheduler is None:
        cfg = dataclasses.replace(cfg, lr_scheduler=label(task.make_scheduler))
    return cfg


def _metrics(cfg: Any, given: Optional[Sequence[Any]], regression: bool, sequence: bool = False,
             target_flag: str = "--stop-at") -> tuple[Metric, ...]:
    """The metrics asked for (``metrics=`` or ``--metric``; else the task's kind's), the loss after them,
    and the stopping target's metric where it is a built-in one not yet among them."""
    flag = "--metric"
    if given is None and cfg.metric is not None:
        given = [part.strip() for part in cfg.metric.split(",") if part.strip()]
    elif given is not None:
        flag = "metrics="
        given = [given] if isinstance(given, (str, Metric)) or callable(given) else list(given)
    kind = REGRESSION if regression else SEQUENCE if sequence else CLASSIFICATION
    chosen = [metric_of(m, flag) for m in given] if given else list(kind)
    names = [m.name for m in chosen]
    if len(set(names)) != len(names):
        raise PhalanxError(f"{flag}: two metrics are named {next(n for n in names if names.count(n) > 1)}; "
                           "give each metric once")
    target = cfg.target
    if target is not None and target.metric not in names and target.metric in BUILT_IN:
        chosen.append(BUILT_IN[target.metric])
    if regression and any(m.name == "accuracy" for m in chosen):
        raise PhalanxError(f"{flag} accuracy: the targets are floats (a regression), and accuracy counts classes; "
                           "use mse, rmse or mae, or give integer class targets")
    measured = with_loss(chosen)
    if target is not None:
        check_target(target, measured, target_flag)
    return measured


def metric_of(spec: Any, flag: str = "--metric") -> Metric:
    """A Metric from a built-in name, an import path, a function (sum, count) or a Metric."""
    if isinstance(spec, Metric):
        return spec
    if isinstance(spec, str) and spec in BUILT_IN:
        return BUILT_IN[spec]
    if is_import_path(spec):
        fn = resolve(spec, flag, "a metric (outputs, targets) -> (sum, count)")
        return user_metric(fn, spec.partition(":")[2].split(".")[-1])
    if callable(spec) and not isinstance(spec, str):
        return user_metric(spec)
    raise PhalanxError(f"{flag} {spec}: unknown metric; choose one of {', '.join(BUILT_IN)}, or MODULE:CALLABLE "
                       "returning (sum, count) for a batch")


def _task_data(cfg: Any, train: Any, test: Any, target_key: Optional[str] = None
               ) -> tuple[Optional[DataBundle], str]:
    """The user's data as a bundle and its name; (None, name) for a built-in set."""
    from ..data.user import user_bundle

    if train is None and test is None and is_import_path(cfg.data):
        load = resolve(cfg.data, "--data", "a callable returning (train, test) datasets")
        try:
            loaded = load()
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:160]
            raise PhalanxError(f"--data {cfg.data}: calling it failed ({type(e).__name__}: {first})") from None
        if not isinstance(loaded, (tuple, list)) or len(loaded) != 2:
            raise PhalanxError(f"--data {cfg.data}: returned {type(loaded).__name__}; expected a pair (train, test) "
                               "of datasets, test may be None")
        train, test = loaded
        return user_bundle(train, test, cfg.validation_split, cfg.seed, cfg.data, f"--data {cfg.data}",
                           cfg.loader_workers, target_key), cfg.data
    if train is not None or test is not None:
        return user_bundle(train, test, cfg.validation_split, cfg.seed, loader_workers=cfg.loader_workers,
                           target_key=target_key), "your data"
    if cfg.loader_workers:
        raise PhalanxError(f"--loader-workers {cfg.loader_workers} reads a Dataset of your own lazily, and --data "
                           f"{cfg.data} is a built-in set held in memory; drop --loader-workers")
    if cfg.validation_split is not None:
        raise PhalanxError(f"--validation-split holds out part of a data set without a test set, and --data "
                           f"{cfg.data} has one; drop --validation-split")
    return None, cfg.data


def _task_parts(model_name: str, optimizer_name: Optional[str], loss_name: Optional[str],
                model: Optional[Any], loss_fn: Optional[Callable],
                optimizer: Optional[OptimizerFactory], regression: bool = False) -> Task:
    if isinstance(model, nn.Module):
        make_model, name = functools.partial(copy_of, model), label(model)
    elif model is not None:  # a factory given to the API: called in every worker, as --model's is
        make_model, name = functools.partial(call_model_factory, model, label(model)), label(model)
    elif is_import_path(model_name):
        factory = resolve(model_name, "--model", "a callable returning a torch.nn.Module")
        make_model, name = functools.partial(call_model_factory, factory, model_name), model_name
    else:
        make_model, name = functools.partial(build_model, model_name), model_name
    if loss_fn is None:
        loss_fn = resolve(loss_name, "--loss", "a loss (outputs, targets) -> scalar tensor") if loss_name \
            else (mse_loss if regression else cross_entropy)
    if optimizer is None and is_import_path(optimizer_name):
        optimizer = resolve(optimizer_name, "--optimizer", "a callable params -> torch.optim.Optimizer")
    return Task(make_model, name, loss_fn=loss_fn, make_optimizer=optimizer)


__all__ = ["OptimizerFactory", "SchedulerFactory", "Task", "call_model_factory", "call_optimizer_factory", "copy_of",
           "importable_cwd", "is_import_path", "label", "metric_of", "named_optimizer", "names_parameter", "resolve",
           "task_from", "user_task"]
