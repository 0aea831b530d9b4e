"""``phalanx compare``: its own options, every training flag that describes the problem, then the comparison.

    phalanx compare --strategies sync,ps,ssp:2,local-sgd:8,hogwild,backup:1 --target 0.95 \\
                    --scenarios none,slow:1:2,pauses:0.1:4 --repeats 3 --workers 3 --out compare-digits

The flags are generated from the dataclasses (``options.py``'s :class:`~phalanx.compare.options.CompareOptions`,
the simulation's, and :class:`~phalanx.train.TrainConfig`'s fields that describe the problem, as for ``phalanx
train``); what was typed becomes those dataclasses, and :func:`~phalanx.compare.engine.compare` runs it, as it
runs ``phalanx.compare(...)`` (``api.py``): the flags and the API's objects make the same Task.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from .. import config_file
from ..errors import PhalanxError
from ..options import add_flags, declared, given
from ..train import TrainConfig
from ..train.config import SECTIONS
from .engine import compare
from .options import CompareOptions, shared_fields


def add_compare_flags(p: argparse.ArgumentParser) -> None:
    from ..units import parse_workers
    from ..options import _argparse_type
    from ..simulate.options import SimulateOptions

    config_file.add_flag(p)
    group = p.add_argument_group("the comparison")
    add_flags(group, CompareOptions)
    # --workers is TrainConfig's, and --simulate takes several counts: one flag, read in run()
    group.add_argument("--workers", dest="workers", default=None, metavar="WORKERS",
                       type=_argparse_type(parse_workers, "--workers"),
                       help="worker processes (default: one per GPU; on CPU, 2); with --simulate, the worker counts "
                            "to simulate, e.g. 8,64,256 (default: 8,64,256)")
    add_flags(p.add_argument_group("the simulation (--simulate: no process runs; the answer at worker counts "
                                   "this machine lacks)"), SimulateOptions)
    shared = set(shared_fields()) - {"workers"}
    for title, names in SECTIONS.items():
        offered = [n for n in names if n in shared]
        if offered:
            add_flags(p.add_argument_group(f"the problem, the same for every run: {title}"), TrainConfig, offered)


def run(args: argparse.Namespace) -> int:
    from ..simulate.options import SimulateOptions

    options = CompareOptions(**given(args, [f.name for f in declared(CompareOptions)]))
    simulation = SimulateOptions(**given(args, [f.name for f in declared(SimulateOptions)]))
    counts = args.workers
    if counts is not None and len(counts) > 1 and not simulation.simulate:
        raise PhalanxError(f"--workers {','.join(map(str, counts))} lists several worker counts: a real comparison "
                           "runs one (give one), --simulate compares several (add --simulate)")
    shared = given(args, [name for name in shared_fields() if name != "workers"])
    if counts is not None and not simulation.simulate:
        shared["workers"] = counts[0]
    train = TrainConfig(**shared)
    command = "phalanx " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["compare"] else None
    compare(options, train, command, simulation, counts)
    return 0
