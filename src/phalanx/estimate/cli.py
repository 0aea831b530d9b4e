"""``phalanx estimate``: flags made from the dataclasses (estimate's own, train's, the strategies'), then the library."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import PhalanxError
from ..options import add_flags as add_fields, declared, field_flag, given
from .options import TRAIN_FLAGS, EstimateOptions, estimated


def _owners() -> dict[str, list[type]]:
    """Strategy flag -> the options classes that take it (several may: ``--sync-every`` is local-sgd's and
    diloco's), in phalanx's order: the fields their cost models depend on."""
    from ..costs import cost_model
    from ..strategies import strategy_class

    owners: dict[str, list[type]] = {}
    for cls in (strategy_class(name) for name in estimated()):
        for field in cost_model(cls).fields:
            owners.setdefault(field, []).append(cls)
    return owners


def add_flags(p: argparse.ArgumentParser) -> None:
    from ..train import TrainConfig

    add_fields(p.add_argument_group("what to predict"), EstimateOptions)
    add_fields(p.add_argument_group("the run, as phalanx train takes it"), TrainConfig, TRAIN_FLAGS)
    group = p.add_argument_group("strategy options (each refused unless its strategy is predicted)")
    for name, classes in _owners().items():
        add_fields(group, classes[0], [name], prefix=f"{', '.join(cls.name for cls in classes)}: ")


def options_from_args(args: argparse.Namespace) -> tuple[EstimateOptions, dict, dict]:
    options = EstimateOptions(**given(args, [f.name for f in declared(EstimateOptions)]))
    owners = _owners()
    typed = given(args, owners)
    for name in typed:
        takers = [cls.name for cls in owners[name]]
        if not set(takers) & set(options.strategies):
            flag = field_flag(owners[name][0], name)
            raise PhalanxError(f"{flag} is an option of {' and '.join(takers)}, and --strategy {options.strategy} does "
                               f"not predict it (drop {flag}, or use --strategy {' or '.join(takers)} or all)")
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
