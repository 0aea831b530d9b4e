"""``phalanx compare``: its own options, every training flag that describes the problem, then the comparison.

    phalanx compare --strategies sync,ps,ssp:2,local-sgd:8,hogwild,backup:1 --target 0.95 \\
                    --scenarios none,slow:1:2,pauses:0.1:4 --repeats 3 --workers 3 --out compare-digits

The training flags are :class:`~phalanx.train.TrainConfig`'s own (model, data, batch, recipe,
devices, seed), generated from its fields as for ``phalanx train`` and the same for every run; the
ones a comparison sets per run (strategy, straggler, steps, evaluation, checkpoints, metrics,
progress) are its own options or are fixed, so they are not offered. :func:`compare` is also what
``phalanx.compare(...)`` runs (``api.py``): the flags and the API's objects make the same Task.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

from .. import config_file
from ..errors import PhalanxError, Stopped
from ..launcher.stop_signals import taken_between_steps
from ..task.metrics import parse_target
from ..options import add_flags, declared, given, option
from ..task import named_optimizer, user_task
from ..train import TrainConfig
from ..train.config import SECTIONS
from ..train.tensorboard import check as check_tensorboard
from . import report
from .outcome import Comparison, report_folder
from .runner import Interrupted, Run, Setup, check, run_all, schedule
from .results import RunResult
from .tokens import parse_scenarios, parse_strategies, parse_strategy

DEFAULT_STRATEGIES = "sync,ps,ssp:2,local-sgd:8,hogwild,backup:1"

#: TrainConfig fields a comparison sets for each run (the rest are the problem's, shared by every run).
PER_RUN = {"strategy", "straggler", "steps", "eval_every", "stop_at", "stop_at_accuracy", "metrics", "checkpoint_dir",
           "checkpoint_every", "keep_checkpoints", "resume", "overwrite", "progress", "log_every",
           "link"}  # a link is a scenario (link:RATE), not a flag shared by every run


@dataclasses.dataclass
class CompareOptions:
    """What to compare, how long to try, and where the report goes."""

    strategies: Optional[str] = option(None, "strategies to compare, each with its main option after a colon "
                                             "(ssp:K, local-sgd:H, backup:B)", parse=lambda text: _checked(text),
                                       show=f"{DEFAULT_STRATEGIES}; on GPUs without hogwild, which needs the CPU")
    target: Union[str, float] = option(0.95, "what each run trains to: accuracy>=0.95, loss<=0.30, perplexity<=5, or "
                                             "a --metric's name with >= or <=; a bare number is an accuracy",
                                       parse=lambda text: _target(text))
    scenarios: str = option("none,slow:1:2,pauses:0.1:4",
                            "scenarios: none, slow:RANK:FACTOR (that rank's compute FACTOR times as long "
                            "every step), pauses:P:FACTOR (every step, each worker FACTOR times as slow with "
                            "probability P), link:RATE (every run on one real link of RATE, e.g. link:100mbit: the "
                            "kernel shapes the job's loopback in a private network namespace; needs root and "
                            "iproute2)")
    repeats: int = option(3, "runs of each strategy in each scenario (medians and min-max)")
    max_steps: Optional[int] = option(None, "a run that has not reached the target after this many steps stops there",
                                      show="2 x the model's recipe steps")
    eval_every: Optional[int] = option(None, "evaluate every N steps (time to target is measured this finely)",
                                       show="about 20 evaluations over --max-steps")
    out: Optional[str] = option(None, "write report.md, report.json, the plots and every run's metrics file here",
                                parse=lambda text: _named_folder(text))

    def __post_init__(self) -> None:
        if self.strategies is not None:  # '' is not "the default": it names no strategy
            _checked(self.strategies)
        if self.out is not None:
            _named_folder(self.out)
        _target(self.target)
        for name in ("repeats", "max_steps", "eval_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise PhalanxError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def _checked(strategies: str) -> str:
    """The --strategies text, once every entry in it parses (at parse time, before anything runs)."""
    parse_strategies(strategies)
    return strategies


def _target(text):
    """The --target as given, once it parses (the metric it names is checked with the problem's metrics)."""
    parse_target(text, "--target")
    return text


def _named_folder(out: str) -> str:
    if not str(out).strip():
        raise PhalanxError("--out '' names no folder: give a folder for the report, e.g. --out compare-digits")
    return out


def shared_fields() -> list[str]:
    return [f.name for f in declared(TrainConfig) if f.name not in PER_RUN]


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
        names = [n for n in names if n in shared]
        if names:
            add_flags(p.add_argument_group(f"the problem, the same for every run: {title}"), TrainConfig, names)


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
    max_steps = options.max_steps or 2 * train.resolved(task.model_name).steps
    eval_every = options.eval_every or max(1, round(max_steps / 20))
    if eval_every > max_steps:
        raise PhalanxError(f"--eval-every {eval_every} is more than --max-steps {max_steps}: no evaluation would "
                           "happen before the end; lower --eval-every")
    strategies = parse_strategies(options.strategies if options.strategies is not None else default_strategies(train))
    return Setup(train, task, tuple(strategies), tuple(parse_scenarios(options.scenarios)), target,
                 options.repeats, max_steps, eval_every)


def _progress(total: int):
    """A tqdm bar over the runs on a terminal; otherwise one line per finished run."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="run", dynamic_ncols=True) if sys.stderr.isatty() else None

    def update(i: int, run: Run, result: Optional[RunResult]) -> None:
        if result is None:
            if bar is not None:
                bar.set_description(run.label)
            return
        outcome = (f"reached the target at step {result.steps_to_target} ({report.seconds(result.seconds_to_target)})"
                   if result.reached
                   else f"not reached (best {'' if result.metric == 'accuracy' else result.metric + ' '}"
                        f"{result.best if result.best is not None else math.nan:.3f})")
        line = f"run {i + 1}/{total}: {run.label}: {outcome}"
        if bar is not None:
            bar.write(line)
            bar.update(1)
        else:
            print(line, file=sys.stderr, flush=True)
        if bar is not None and i + 1 == total:
            bar.close()

    return update


def compare(options: CompareOptions, train: TrainConfig, command: Optional[str] = None, simulation=None,
            workers: Optional[tuple[int, ...]] = None, objects: Optional[dict[str, Any]] = None):
    """Run the comparison; print the tables and the answer; with ``options.out``, write the report
    and plots there. Returns the :class:`~phalanx.compare.outcome.Comparison`.

    ``simulation`` (:class:`~phalanx.simulate.options.SimulateOptions` with ``simulate``): compute it by
    event simulation at the worker counts ``workers`` instead (``phalanx.simulate``). ``objects``: the
    Python API's model, data, loss, optimizer and metrics (see :func:`setup_from`)."""
    if simulation is not None and simulation.simulate:
        from .simulated import compare_simulated

        return compare_simulated(options, train, simulation, workers, command, objects)
    setup = setup_from(options, train, objects)
    checked = check(setup)
    total = len(schedule(setup))
    print(f"phalanx compare: {len(setup.strategies)} strategies x {len(setup.scenarios)} scenarios x "
          f"{setup.repeats} repeats = {total} runs, each to {report.target_words(setup.target)} or {setup.max_steps} "
          f"steps (evaluated every {setup.eval_every}); {checked.workers} workers, {setup.task.model_name} on "
          f"{setup.task.data_name}", flush=True)
    out = report_folder(options.out)
    interrupted: Optional[Interrupted] = None
    with tempfile.TemporaryDirectory(prefix="phalanx-compare-") as tmp, taken_between_steps():
        root = out or Path(tmp)
        try:
            runs = run_all(setup, checked, root, _progress(total))
        except Interrupted as e:  # what finished is still worth a report, marked incomplete
            interrupted, runs = e, e.finished
        files = {r.metrics: (root / r.metrics).read_text() for r in runs}
    result = Comparison(setup, checked, runs, report.tables(setup, runs), files, command,
                        incomplete_note(interrupted))
    print("\n" + result.tables + "\n")
    print(result.answer)
    written: list[Path] = []
    if out is not None:
        written = result.save(out)
        print(f"\nreport {written[0]}, {written[1].name}; plots " + ", ".join(p.name for p in written[2:]))
    if interrupted is not None:
        where = (f"the partial report of the {len(runs)} finished run(s), marked incomplete: {written[0]}"
                 if written else "no --out, so no report was written; the tables above hold the finished runs")
        raise Stopped(f"compare {interrupted.describe()}; {where}", interrupted.signame)
    return result


def incomplete_note(interrupted: Optional[Interrupted]) -> Optional[dict]:
    if interrupted is None:
        return None
    return {"stopped_by": interrupted.signame, "interrupted_run": interrupted.index + 1,
            "interrupted_label": interrupted.run.label, "runs_finished": len(interrupted.finished),
            "runs_planned": interrupted.total}


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
