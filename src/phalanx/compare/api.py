"""``phalanx.compare(...)``: the comparison from Python, on the caller's own model and data objects.

    import phalanx
    result = phalanx.compare(model=Net(), train_data=(x, y), test_data=(x_test, y_test),
                             strategies="sync,ps", scenarios="none", target=0.9, repeats=1)
    print(result.answer)
    result.save("compare-report")   # what `phalanx compare --out compare-report` writes

The keywords are the command's flags: the comparison's own (``strategies``, ``scenarios``,
``target``, ``repeats``, ``max_steps``, ``eval_every``), the simulation's (``simulate=True`` and
its ``step_time``, ``link_bandwidth``, ``link_latency``, ``per_node``, ``race``) and every training flag the
command takes (``batch_size``, ``lr``, ``devices``, ``seed``, ``tensorboard``, ``model="cnn"``,
``data="digits"`` ...). They are checked by the same dataclasses and run by the same
:func:`~phalanx.compare.engine.compare` as the command's, so a bad value is the same one line.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, TypeVar, Union

from ..errors import PhalanxError
from ..options import declared, parsed_as_flag

if TYPE_CHECKING:
    from .outcome import Comparison
    from .simulated import SimulatedComparison

T = TypeVar("T")

#: TrainConfig fields a comparison sets per run, and what to give instead
PER_RUN_INSTEAD = {"steps": "max_steps=", "stop_at": "target=", "stop_at_accuracy": "target=",
                   "strategy": "strategies=", "straggler": "scenarios= (slow:RANK:FACTOR, pauses:P:FACTOR)",
                   "link": "scenarios= (link:RATE)"}


def compare(*, model: Any = None, train_data: Any = None, test_data: Any = None,
            loss_fn: Optional[Callable[..., Any]] = None, optimizer: Optional[Callable[..., Any]] = None,
            metrics: Any = None,
            strategies: Union[str, Iterable[str], None] = None, scenarios: Union[str, Iterable[str], None] = None,
            target: Union[str, float, None] = None, repeats: Optional[int] = None, workers: Optional[int] = None,
            max_steps: Optional[int] = None, eval_every: Optional[int] = None, simulate: bool = False,
            simulate_workers: Union[str, Iterable[int], None] = None,
            **settings: Any) -> Union[Comparison, SimulatedComparison]:
    """Which strategy reaches the target first on this problem; prints what ``phalanx compare`` prints and
    returns a :class:`~phalanx.compare.outcome.Comparison` (``simulate=True``: a
    :class:`~phalanx.compare.simulated.SimulatedComparison`) with ``tables``, ``answer``, ``runs``,
    ``table`` and ``save(dir)``.

    ``model``: an ``nn.Module`` (every run trains a copy of it, so every run starts from its weights)
    or a name as ``--model`` takes it (``"cnn"``, ``"mymodels:Net"``); ``train_data``/``test_data``,
    ``loss_fn``, ``optimizer`` (``params -> Optimizer``), ``metrics``, ``lr_scheduler`` and ``training_step``:
    as ``phalanx.Trainer`` takes them. Unset keywords take the command's defaults. ``workers``: the worker
    processes of every run;
    ``simulate_workers``: the worker counts a simulation compares (default 8, 64, 256).
    """
    from ..simulate.options import SimulateOptions
    from ..train import TrainConfig
    from .engine import compare as run
    from .options import CompareOptions, shared_fields

    if isinstance(model, str):
        settings["model"], model = model, None
    # An LR scheduler factory travels with the task, as the optimizer does; an import path is a setting.
    scheduler = settings.pop("lr_scheduler") if callable(settings.get("lr_scheduler")) else None
    step = settings.pop("training_step") if callable(settings.get("training_step")) else None  # likewise
    sim_names = {f.name for f in declared(SimulateOptions)} - {"simulate"}
    sim = {k: parsed_as_flag(SimulateOptions, k, v) for k, v in settings.items() if k in sim_names}
    train = {k: v for k, v in settings.items() if k not in sim_names}
    _refuse_unknown(train, set(shared_fields()))
    default = CompareOptions()  # an unset keyword takes the flag's default
    options = CompareOptions(strategies=None if strategies is None else _listed(strategies, "strategies"),
                             scenarios=default.scenarios if scenarios is None else _listed(scenarios, "scenarios"),
                             target=_or(target, default.target), repeats=_or(repeats, default.repeats),
                             max_steps=max_steps, eval_every=eval_every)
    simulation = SimulateOptions(simulate=bool(simulate), **sim)
    counts = None
    if simulate:
        if workers is not None:
            raise PhalanxError(f"workers={workers} is a real comparison's worker count; a simulation compares "
                               "several: give simulate_workers=(8, 64, 256)")
        if simulate_workers is not None:
            from ..units import parse_workers

            counts = parse_workers(_listed(simulate_workers, "simulate_workers"))
    elif simulate_workers is not None:
        raise PhalanxError("simulate_workers= are the worker counts of a simulation: add simulate=True, or give "
                           "workers= for the real comparison")
    elif workers is not None:
        train["workers"] = workers
    config = TrainConfig(**train)
    objects = {"model": model, "train_data": train_data, "test_data": test_data, "loss_fn": loss_fn,
               "optimizer": optimizer, "metrics": metrics, "lr_scheduler": scheduler,
               "training_step": step}
    return run(options, config, None, simulation, counts, objects)


def _or(value: Optional[T], default: T) -> T:
    return default if value is None else value


def _listed(value: Union[str, Iterable[object]], name: str) -> str:
    """``"sync,ps"`` or ``["sync", "ps"]`` (``(8, 64)``) as the flag's comma-separated text."""
    if isinstance(value, str):
        return value
    try:
        return ",".join(str(v) for v in value)
    except TypeError:
        raise PhalanxError(f"{name}={value!r}: give a comma-separated string or a list, e.g. "
                           f"{name}={'(8, 64, 256)' if name == 'simulate_workers' else repr('sync,ps')}") from None


def _refuse_unknown(settings: dict[str, Any], shared: set[str]) -> None:
    for name in settings:
        if name in shared:
            continue
        if name in PER_RUN_INSTEAD:
            raise PhalanxError(f"{name}= is set for each run by the comparison; give {PER_RUN_INSTEAD[name]} instead")
        from ..train import TrainConfig

        known = {f.name for f in dataclasses.fields(TrainConfig)}
        if name in known:
            raise PhalanxError(f"{name}= is set for each run by the comparison (metrics files, checkpoints and "
                               "progress are the comparison's own); drop it, and save the report with .save(dir)")
        raise PhalanxError(f"compare() has no setting {name}=; it takes the comparison's keywords and the training "
                           "settings of phalanx.TrainConfig (batch_size, lr, devices, seed ...)")
