"""From the comparison's options and the shared training settings to its :class:`~phalanx.compare.runner.Setup`,
checked: the user's problem made once, the target checked against its metrics, the defaults filled in. The real
comparison (``engine.py``) and the simulated one (``simulated.py``) start here alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..errors import PhalanxError
from ..task import named_optimizer, user_task
from ..task.metrics import parse_target
from ..train import TrainConfig
from ..train.tensorboard import check as check_tensorboard
from .options import DEFAULT_STRATEGIES, CompareOptions
from .runner import Setup
from .tokens import parse_scenarios, parse_strategies, parse_strategy


def default_strategies(train: TrainConfig) -> str:
    """Every default strategy that runs on the chosen devices: on GPUs, less those that run on the CPU only
    (hogwild shares CPU memory)."""
    from ..train.trainer import worker_devices

    if worker_devices(train)[0].type == "cpu":
        return DEFAULT_STRATEGIES
    return ",".join(t for t in DEFAULT_STRATEGIES.split(",") if not parse_strategy(t).options.cpu_only)


def setup_from(options: CompareOptions, train: TrainConfig, objects: Optional[dict[str, Any]] = None) -> Setup:
    """The comparison, checked; ``objects``: what ``phalanx.compare()`` was given (model, train_data,
    test_data, loss_fn, optimizer, metrics), else the flags' names make the Task."""
    check_tensorboard(train.tensorboard)
    target = parse_target(options.target, "--target")
    # The Task first: its model picks the recipe (the default --max-steps), and it checks that the
    # target's metric is reported (any eval_every will do for the config's own check of a target).
    stopping = dataclasses.replace(train, stop_at=str(target), stop_at_accuracy=None, eval_every=1)
    task = user_task(stopping, target_flag="--target", **(objects or {}))
    train = named_optimizer(train, task)
    max_steps = options.max_steps or 2 * train.resolved(task.model_name).total_steps
    eval_every = options.eval_every or max(1, round(max_steps / 20))
    if eval_every > max_steps:
        raise PhalanxError(f"--eval-every {eval_every} is more than --max-steps {max_steps}: no evaluation would "
                           "happen before the end; lower --eval-every")
    strategies = parse_strategies(options.strategies if options.strategies is not None else default_strategies(train))
    return Setup(train, task, tuple(strategies), tuple(parse_scenarios(options.scenarios)), target,
                 options.repeats, max_steps, eval_every)
