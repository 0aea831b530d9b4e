"""A comparison from start to end, the same for ``phalanx.compare(...)`` and ``phalanx compare``: the setup
checked, every run trained, the tables and the answer printed, the report written; ``--simulate`` hands over to
``simulated.py``. A stop signal between or during runs ends it with the report of the runs that finished,
marked incomplete, then :class:`~phalanx.errors.Stopped`.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from ..errors import Stopped
from ..launcher.stop_signals import taken_between_steps
from ..train import TrainConfig
from . import report
from .options import CompareOptions
from .outcome import Comparison, report_folder
from .results import RunResult
from .runner import Interrupted, Run, check, run_all, schedule
from .setup import setup_from

if TYPE_CHECKING:
    from ..simulate.options import SimulateOptions
    from .simulated import SimulatedComparison


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


def compare(options: CompareOptions, train: TrainConfig, command: Optional[str] = None,
            simulation: Optional[SimulateOptions] = None, workers: Optional[tuple[int, ...]] = None,
            objects: Optional[dict[str, Any]] = None) -> Union[Comparison, SimulatedComparison]:
    """Run the comparison; print the tables and the answer; with ``options.out``, write the report
    and plots there. Returns the :class:`~phalanx.compare.outcome.Comparison`.

    ``simulation`` (:class:`~phalanx.simulate.options.SimulateOptions` with ``simulate``): compute it by
    event simulation at the worker counts ``workers`` instead (``phalanx.simulate``). ``objects``: the
    Python API's model, data, loss, optimizer and metrics (see :func:`~phalanx.compare.setup.setup_from`).
    ``command``: the command line, for the report's Setup section."""
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
                        None if interrupted is None else interrupted.incomplete())
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
