"""What an estimate is computed for: the checked inputs, and which rows and conditions follow from them.

:func:`prepare` makes every check that needs no measurement (bad input is one line before anything
runs), reads the model's sizes and decides the rows: for every strategy and worker count, the
strategy's cost model proposes its options (a pipeline its stage count) and the strategy's own
``layout()`` accepts them or says why not, exactly as ``phalanx train`` would; nothing here knows
which strategy needs what. :func:`conditions_for` says under which conditions a row's worker computes
(how many processes share its node, how many threads each has); :func:`predict` asks the strategy's
cost model (``phalanx/costs/``) for one row.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from ..costs import Compute, CostModel, ModelFacts, Network, Prediction, modelled_cost
from ..devices import resolve_devices
from ..errors import PhalanxError
from ..launcher import available_cores
from ..task.step import UserStep, calls_model_alone
from ..data import batch as batches
from ..data.user import cast_to_model
from ..task import Task, named_optimizer, task_from, user_task
from ..strategies import Job, Options, strategy_class
from ..train import TrainConfig
from .facts import model_facts
from .options import EstimateOptions, estimated
from .profile import Conditions

DEFAULT_BUCKET_MB = 25.0  #: the gradient bucket cap when no estimated strategy names one (DDP's default)


@dataclasses.dataclass(frozen=True)
class Row:
    """One strategy on one worker count, as its layout accepted it."""

    options: Options  #: the strategy's options for this count (a pipeline's stage count chosen)
    workers: int
    processes: int  #: the layout's world size: the workers and any process beside them (a parameter server)

    @property
    def cost(self) -> CostModel:
        return modelled_cost(self.options)

    @property
    def strategy(self) -> str:
        return self.options.name


@dataclasses.dataclass
class Setup:
    """Everything checked before a measurement starts."""

    options: EstimateOptions
    config: TrainConfig  #: resolved: the recipe's optimizer and the data defaults filled in
    task: Task  #: the user's problem (what is measured: its model, data and optimizer)
    #: every estimated strategy's options class -> its options with the flags typed (predicted or not)
    strategies: dict[type[Options], Options]
    device: torch.device
    per_node: int
    cores: int
    model: nn.Module
    facts: ModelFacts
    input_shape: tuple
    bucket_mb: float  #: the gradient bucket cap ``facts.buckets`` were cut at
    example: Any = None  #: a batch of the data as the step takes it (any tree: a pair, a dict, nested)
    rows: list[Row] = dataclasses.field(default_factory=list)  #: what is predicted, strategy by strategy
    skipped: list[str] = dataclasses.field(default_factory=list)  #: rows that cannot exist, and why

    @property
    def predicted(self) -> list[type[Options]]:
        """The options classes of the strategies asked for, in the order of ``--strategy all``."""
        return [strategy_class(name) for name in self.options.strategies]


# --------------------------------------------------------------------------- checks (no measurement)

def prepare(options: EstimateOptions, train_values: dict, strategy_values: dict,
            objects: Optional[dict] = None) -> Setup:
    """Check everything and read the model; ``*_values``: the flags the user typed, by field name;
    ``objects``: what ``phalanx.estimate()`` was given (model, train_data, test_data, optimizer)."""
    config = TrainConfig(**train_values)
    # the API's objects, else the user's model and data by import path, or the built-in ones
    task = user_task(config, **objects) if objects else task_from(config)
    config = named_optimizer(config, task).resolved(task.model_name)
    strategies = {cls: cls(**{k: v for k, v in strategy_values.items() if k in modelled_cost(cls).fields})
                  for cls in map(strategy_class, estimated())}
    from ..train.checks import data_facts

    facts = data_facts(config, task.data)
    if config.batch_size > facts.train_size:
        raise PhalanxError(f"--batch-size {config.batch_size} is larger than the {facts.train_size} training "
                           "examples; use a smaller --batch-size")
    device = resolve_devices(config.devices)[0]
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    per_node = options.per_node or (gpus if device.type == "cuda" else 2)
    _check_links(options, device, per_node, gpus)
    torch.manual_seed(config.seed)
    model = task.make_model(facts.input_shape, facts.num_classes)
    if task.data is not None:  # float64 numpy inputs meet float32 parameters, as in train
        facts = data_facts(config, cast_to_model(task.data, model))
    caps = (modelled_cost(o).bucket_mb(o) for o in strategies.values())
    bucket_mb = next((cap for cap in caps if cap is not None), DEFAULT_BUCKET_MB)
    sizes = model_facts(model, facts.example, config.batch_size, bucket_mb, task.step)
    setup = Setup(options, config, task, strategies, device, per_node, available_cores(), model, sizes,
                  tuple(facts.input_shape), bucket_mb, facts.example)
    for cls in setup.predicted:
        _plan_strategy(setup, cls, typed=any(k in modelled_cost(cls).fields for k in strategy_values))
    return setup


def _check_links(options: EstimateOptions, device: torch.device, per_node: int, gpus: int) -> None:
    """Every link the rows need is measurable here or given (``run.settle_links`` then finds it so), before
    minutes of measuring end in a refusal."""
    if device.type == "cpu":
        if options.measure_link is False and not options.link_given:
            raise PhalanxError("--no-measure-link on CPU workers leaves the link between them unknown: give "
                               "--link-bandwidth and --link-latency, or let --measure-link measure it")
        return
    if options.link_given:
        return
    if options.measure_link and gpus < 2:
        raise PhalanxError("--measure-link on GPUs needs 2 GPUs here to time a link between them, and this "
                           f"machine has {gpus}; give --link-bandwidth and --link-latency")
    if max(options.workers) > per_node:
        raise PhalanxError(f"--workers {max(options.workers)} spans several machines of {per_node} GPUs: give the "
                           "network between them with --link-bandwidth and --link-latency (e.g. 25GB/s and 10us)")
    if per_node >= 2 and gpus < 2 and not options.measure_link:
        raise unknown_gpu_link(per_node, gpus)


def unknown_gpu_link(per_node: int, gpus: int) -> PhalanxError:
    return PhalanxError(f"--per-node {per_node} but this machine has {gpus} GPU(s), so the link between GPUs of a "
                        "machine is unknown: give --link-bandwidth and --link-latency, or run on that machine")


def _plan_strategy(setup: Setup, cls: type[Options], typed: bool) -> None:
    """Rows of one strategy, or 'not predicted' lines naming the layout's reason. A strategy the user asked
    for by name or by its flags that runs on none of the counts asked is an error: there is nothing to show."""
    reasons = []
    for n in setup.options.workers:
        row, reason = plan_row(setup, setup.strategies[cls], n)
        if row is not None:
            setup.rows.append(row)
        else:
            reasons.append(f"{cls.name} on {n} worker{'s' * (n != 1)}: {reason}")
    if reasons and len(reasons) == len(setup.options.workers) and (typed or setup.options.strategy != "all"):
        raise PhalanxError(reasons[-1])
    setup.skipped += reasons


def plan_row(setup: Setup, options: Options, workers: int) -> tuple[Optional[Row], str]:
    """The first of the cost model's plans whose layout accepts ``workers`` workers (with the reason the first
    plan was refused, else)."""
    blocks = len(setup.facts.block_names)
    refused = refuses_task(setup, options)
    if refused:
        return None, refused
    job = Job((setup.device,) * workers, setup.config.batch_size, model=setup.model)
    refused = ""
    for plan in modelled_cost(options).plans(options, workers, blocks, setup.per_node):
        try:
            layout = plan.layout(job)
        except PhalanxError as e:
            refused = refused or str(e)
            continue
        return Row(plan, workers, layout.world_size), ""
    return None, refused or f"no plan of {options.name} fits {workers} workers and {blocks} blocks"


def refuses_task(setup: Setup, options: Options) -> str:
    """The one line where the strategy's cost is timed on batches (inputs, targets) through the model's blocks (a
    pipeline's) and the task's batches or step are others; "" where the estimate takes the task."""
    if not options.estimated_on_pairs or setup.example is None:
        return ""
    if isinstance(setup.task.step, UserStep):
        what = "this run's training step is your own"
    elif not batches.is_pair(setup.example):
        what = f"this data's batches are {batches.describe(setup.example)}"
    elif not calls_model_alone(setup.task.step, setup.model):
        what = "this model's forward takes the targets (it is called model(x, y))"
    else:
        return ""
    return (f"phalanx estimate times {options.name} on batches (inputs, targets) run through the model's blocks, and "
            f"{what}; phalanx train and compare run it, estimate does not predict it")


# --------------------------------------------------------------------------- rows

def alone(setup: Setup) -> Conditions:
    """One worker training alone on this machine (every core its own): what speedup is measured against."""
    return _conditions(setup, local=1, beside=0)


def conditions_for(setup: Setup, row: Row) -> Conditions:
    """The processes that would share a node and the threads each would have (as phalanx's launcher gives them):
    the row's workers on node 0, and any process its layout starts beside them (a parameter server) there too."""
    return _conditions(setup, local=min(row.workers, setup.per_node), beside=row.processes - row.workers)


def _conditions(setup: Setup, local: int, beside: int) -> Conditions:
    if setup.device.type == "cuda":
        return Conditions(1, setup.config.threads or max(1, setup.cores // local), "cuda:0")
    return Conditions(local, setup.config.threads or max(1, setup.cores // (local + beside)), "cpu", beside)


def predict(setup: Setup, row: Row, compute: Compute, net: Network, *, facts: Optional[ModelFacts] = None,
            options: Optional[Options] = None) -> Prediction:
    """One row; ``facts`` and ``options`` replace the row's for the advice (a larger batch, other options).
    Named by the row's strategy, whatever name its cost model's formula gives (two strategies may share one)."""
    p = row.cost.predict(options or row.options, compute, facts or setup.facts, net, row.workers)
    return p if p.strategy == row.strategy else dataclasses.replace(p, strategy=row.strategy)
