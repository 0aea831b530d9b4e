"""``phalanx estimate``: flags made from the dataclasses (estimate's own, train's, the strategies'), then
:func:`phalanx.estimate.api.estimate` with what was typed, as Python would call it."""

from __future__ import annotations

import argparse
import json
import sys

from ..options import add_flags as add_fields, given
from .options import TRAIN_FLAGS, EstimateOptions, names, owners


def add_flags(p: argparse.ArgumentParser) -> None:
    from ..train import TrainConfig

    add_fields(p.add_argument_group("what to predict"), EstimateOptions)
    add_fields(p.add_argument_group("the run, as phalanx train takes it"), TrainConfig, TRAIN_FLAGS)
    group = p.add_argument_group("strategy options (each refused unless its strategy is predicted)")
    for name, classes in owners().items():
        add_fields(group, classes[0], [name], prefix=f"{', '.join(cls.name for cls in classes)}: ")


def run(args: argparse.Namespace) -> int:
    from .api import estimate
    from .options import check_plot_suffix
    from .report import check_plot_path

    settings = given(args, names())
    plot, as_json = settings.pop("plot", None), settings.pop("json", False)
    if plot is not None:  # before minutes of measuring, not after
        check_plot_suffix(plot)
        check_plot_path(plot)
    result = estimate(**settings)
    if plot is not None:
        result.plot(plot)
        print(f"plot {plot}", file=sys.stderr)
    print(json.dumps(result.to_dict(), indent=2) if as_json else result.table)
    return 0
