"""``phalanx estimate``: flags made from the dataclasses (estimate's own, train's, the strategies'), then the library."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import PhalanxError
from ..options import add_flags as add_fields, declared, field_flag, given
from .options import ESTIMATED, TRAIN_FLAGS, EstimateOptions


def _owners() -> dict[str, tuple[str, type]]:
    """Strategy flag -> (the strategy that takes it, its options class): the fields its cost model depends on."""
    from ..costs import cost_model
    from ..strategies import strategy_class

    classes = [strategy_class(name) for name in ESTIMATED]
    return {field: (cls.name, cls) for cls in classes for field in cost_model(cls).fields}


def add_flags(p: argparse.ArgumentParser) -> None:
    from ..train import TrainConfig

    add_fields(p.add_argument_group("what to predict"), EstimateOptions)
    add_fields(p.add_argument_group("the run, as phalanx train takes it"), TrainConfig, TRAIN_FLAGS)
    group = p.add_argument_group("strategy options (each refused unless its strategy is predicted)")
    for name, (strategy, cls) in _owners().items():
        add_fields(group, cls, [name], prefix=f"{strategy}: ")


def options_from_args(args: argparse.Namespace) -> tuple[EstimateOptions, dict, dict]:
    options = EstimateOptions(**given(args, [f.name for f in declared(EstimateOptions)]))
    owners = _owners()
    typed = given(args, owners)
    for name in typed:
        strategy, cls = owners[name]
        if strategy not in options.strategies:
            flag = field_flag(cls, name)
            raise PhalanxError(f"{flag} is an option of {strategy}, and --strategy {options.strategy} does not predict "
                               f"it (drop {flag}, or use --strategy {strategy} or all)")
    return options, given(args, TRAIN_FLAGS), typed


def run(args: argparse.Namespace) -> int:
    from .report import check_plot_path, describe, plot
    from .run import run as estimate
    from .setup import prepare

    options, train_values, strategy_values = options_from_args(args)
    if options.plot:
        check_plot_path(options.plot)
    setup = prepare(options, train_values, strategy_values)
    result = estimate(setup, lambda line: print(line, file=sys.stderr, flush=True))
    if options.plot:
        plot(result, options.plot)
        print(f"plot {options.plot}", file=sys.stderr)
    print(json.dumps(result.to_dict(), indent=2) if options.json else describe(result))
    return 0
