"""``phalanx compare --simulate``: the comparison of ``phalanx compare``, at worker counts this machine lacks.

The same strategies, scenarios, target, repeats and report as a real comparison (``compare/``),
run by the simulation instead of by processes: for every worker count, every repeat, scenario and
strategy, one :class:`~phalanx.simulate.world.World` played by the strategy's simulated rule.
Repeat r uses seed + r, as real runs do. The strategies race (``--race``, on by default): at each worker
count and scenario they run fastest first at the last count, and a run stops once its simulated clock passes
the fastest median time to target found so far, since it can no longer be first (reported as ``> T``); the
winner and its time are those of running everything to the end, and far fewer gradients are computed. The
target is any metric a real comparison takes (``accuracy>=0.95``, ``loss<=0.3``, ``perplexity<=5``, a
``--metric`` of the user's), evaluated as a real run evaluates (``world.py``). Checked first, in one line
each, before anything runs: a strategy without a simulated rule, a ``link:RATE`` scenario (a real link; here
the link is ``--link-bandwidth``), a worker count a strategy's layout refuses, a target no reported metric
reaches (the real check: ``task/``), a global batch larger than the data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from ..costs import Link
from ..errors import PhalanxError, Stopped
from ..launcher.stop_signals import stop_if_asked, taken_between_steps
from ..simulate.registry import RULES, simulated_rule
from ..simulate.world import World, stacked_copies, takes_the_model
from ..strategies import STRATEGIES, Job
from ..train import TrainConfig
from . import simulated_report as report
from . import runner
from .outcome import report_folder, writable
from .report import target_words
from .results import Figures, RunResult, figures
from .setup import default_strategies as real_defaults
from .setup import setup_from
from .simulated_problem import Problem, build_problem
from .tokens import Scenario, StrategyToken, parse_strategy


@dataclasses.dataclass(frozen=True)
class SimRun:
    workers: int
    strategy: StrategyToken
    scenario: Scenario
    repeat: int
    seed: int

    @property
    def label(self) -> str:
        return f"{self.strategy.token} under {self.scenario.token} at {self.workers} workers, repeat {self.repeat + 1}"


class Interrupted(runner.Interrupted):
    """SIGINT or SIGTERM during a simulated run: ``problem`` and ``by_workers`` hold what finished before it."""

    def __init__(self, problem: Problem, by_workers: dict, index: int, total: int, run: SimRun, signame: str):
        super().__init__([r for runs in by_workers.values() for r in runs], index, total, run, signame)
        self.problem, self.by_workers = problem, by_workers


def check(setup, workers: tuple[int, ...]) -> None:
    """Every (strategy, scenario, worker count) before anything runs; one line for the first that cannot.
    (The task's metrics were checked against the target when the comparison was set up.)"""
    if setup.train.tensorboard is not None:
        raise PhalanxError(f"--tensorboard {setup.train.tensorboard} draws real runs' curves, and --simulate runs no "
                           "process: drop --tensorboard, or compare for real without --simulate")
    for scenario in setup.scenarios:
        if scenario.link is not None:
            raise PhalanxError(f"--scenarios {scenario.token} is a real shaped link and --simulate runs no process: "
                               "give the simulated link with --link-bandwidth and --link-latency (e.g. 50Mb/s, 100us)")
    simulated = ", ".join(sorted(name for name, cls in STRATEGIES.items() if cls in RULES))
    factory = setup.task.make_optimizer
    for strategy in setup.strategies:
        rule = simulated_rule(strategy.options)
        if rule is None:
            raise PhalanxError(f"{strategy.token} has no simulated rule yet (--simulate covers {simulated}); drop it "
                               "from --strategies, or compare it for real without --simulate")
        if takes_the_model(factory) and not rule.steps_a_module:
            raise PhalanxError(stacked_copies(factory, strategy.options.name))
        for n in workers:
            try:
                strategy.options.layout(Job((torch.device("cpu"),) * n, setup.train.batch_size))
            except PhalanxError as e:
                raise PhalanxError(f"{strategy.token} at {n} workers: {e}") from None
    for scenario in setup.scenarios:
        s = scenario.slowness
        if s is not None and s.kind == "slow" and s.rank > max(workers):
            raise PhalanxError(f"--scenarios {scenario.token}: rank {s.rank} does not exist at {max(workers)} workers")


def target_config(setup) -> TrainConfig:
    """The shared training flags with the comparison's target and evaluations, as every real run gets them
    (``compare/runner.config_for``): the task's metrics then include the target's, or refuse it."""
    return dataclasses.replace(setup.train, stop_at=str(setup.target), stop_at_accuracy=None,
                               eval_every=setup.eval_every)


def beside(setup, workers: tuple[int, ...]) -> int:
    """The most processes any strategy runs beside its workers (a parameter server), as its layout says
    (at the largest count, which every layout accepted in :func:`check`)."""
    job = Job((torch.device("cpu"),) * max(workers), setup.train.batch_size)
    return max((s.options.layout(job).world_size - job.workers for s in setup.strategies), default=0)


def default_strategies(text: str) -> str:
    """compare's default strategies, less those with no simulated rule (hogwild shares one machine's memory)."""
    return ",".join(t for t in text.split(",") if simulated_rule(parse_strategy(t).options) is not None)


def count(setup, workers: tuple[int, ...]) -> int:
    """How many runs the comparison simulates: every worker count x repeat x scenario x strategy."""
    return len(workers) * setup.repeats * len(setup.scenarios) * len(setup.strategies)


def deadline(fastest: float, repeats: int) -> float:
    """Simulated seconds past which a strategy's run cannot make its median time to target beat ``fastest``,
    the fastest median found so far (the race). With an odd number of repeats, a run stopped past ``fastest``
    is slower than every repeat that reached the target by then, so the median is exact or above ``fastest``.
    With an even number, the median is the mean of the middle two: a run stopped past twice ``fastest`` keeps
    that mean above ``fastest`` whatever the other middle one is."""
    return fastest if repeats % 2 else 2 * fastest


def race_order(strategies, medians: Optional[dict[str, float]]) -> list:
    """The strategies, fastest first at the last worker count simulated (as given at the first): the sooner
    a fast one runs, the sooner the others stop."""
    if medians is None:
        return list(strategies)
    return sorted(strategies, key=lambda s: medians[s.token])


def run_one(problem: Problem, setup, run: SimRun, fastest: float = math.inf, race: bool = False):
    """Simulate one run and read it back as a real run's :class:`~phalanx.compare.results.RunResult`; ``race``:
    stop it once it can no longer beat ``fastest`` (:func:`deadline`)."""
    options = run.strategy.options
    target = setup.target
    world = World(problem, options, run.workers, run.scenario.slowness, run.seed, setup.max_steps,
                  setup.eval_every, target, deadline(fastest, setup.repeats) if race else math.inf)
    rule = simulated_rule(options)
    assert rule is not None, "check() refused a strategy without a simulated rule"
    rule.run(options, world)
    out = world.finish()
    first = next((p for p, values in zip(out.curve, out.values) if target.reached(values)), None)
    examples = None
    if first is not None:  # the run stopped there: what it applied by then (the server counts it)
        batch = setup.train.batch_size
        examples = out.applied * batch if out.applied is not None else first["step"] * batch * run.workers
    staleness = None
    if world.staleness is not None and world.staleness.total:
        s = world.staleness.to_dict()
        staleness = {"mean": s["staleness_mean"], "p95": s["staleness_p95"], "max": s["staleness_max"],
                     "histogram": s["staleness_histogram"]}
    dropped = None
    if out.dropped is not None and (out.dropped or out.drops):
        dropped = {"total": out.dropped, "of": out.dropped + (out.applied or 0), "by_worker": out.dropped_by}
    accuracies = [v["accuracy"] for v in out.values if "accuracy" in v]
    seen = [v[target.metric] for v in out.values if not math.isnan(v.get(target.metric, math.nan))]
    return RunResult(
        strategy=run.strategy.token, scenario=run.scenario.token, repeat=run.repeat, seed=run.seed,
        reached=first is not None, diverged=out.diverged, steps_to_target=int(first["step"]) if first else None,
        seconds_to_target=first["seconds"] if first else None, examples_to_target=examples,
        best_accuracy=max(accuracies, default=None), final_accuracy=accuracies[-1] if accuracies else None,
        steps=out.steps, train_seconds=out.seconds, eval_seconds=0.0, wall_seconds=out.wall_seconds,
        startup_seconds=0.0, examples_per_sec=out.examples / max(out.seconds, 1e-12), staleness=staleness,
        dropped=dropped, calibrated_compute_s={}, curve=[dict(p) for p in out.curve],
        metrics=f"simulated at {run.workers} workers (peak {out.peak_versions} parameter versions held)",
        metric=target.metric, higher=target.higher, best=(max if target.higher else min)(seen, default=None),
        final=out.values[-1].get(target.metric) if out.values else None,
        stopped_behind=fastest if out.outrun else None)


def simulate_compare(setup, workers: tuple[int, ...], sim, say: Callable[[str], None],
                     progress: Optional[Callable[[int, int, SimRun, object], None]] = None) -> tuple[Problem, dict]:
    """Every run of the comparison, simulated; returns the problem and ``{workers: [RunResult]}``."""
    check(setup, workers)
    link = Link(sim.link_latency, 1.0 / sim.link_bandwidth, "given by --link-bandwidth and --link-latency") \
        if sim.link_bandwidth is not None else None
    problem = build_problem(target_config(setup), workers, sim.per_node, sim.step_time, link, say, setup.task,
                            beside(setup, workers))
    size = len(problem.data(setup.train.seed).train)
    if setup.train.batch_size * max(workers) > size:
        raise PhalanxError(f"global batch {setup.train.batch_size * max(workers)} "
                           f"({setup.train.batch_size} per worker x "
                           f"{max(workers)} workers) is larger than the {size} training examples; use a smaller "
                           "--batch-size, or data large enough for the largest worker count")
    results: dict[int, list] = {n: [] for n in workers}
    total, done = count(setup, workers), 0
    medians: dict[str, dict[str, float]] = {}  #: scenario -> strategy -> median time at the last worker count
    run: Optional[SimRun] = None
    try:
        with _threads(setup.train.threads):
            for n in workers:
                for scenario in setup.scenarios:
                    fastest, mine = math.inf, {}
                    for strategy in race_order(setup.strategies, medians.get(scenario.token)):
                        for r in range(setup.repeats):
                            run = SimRun(n, strategy, scenario, r, setup.train.seed + r)
                            stop_if_asked()  # (a simulated run also stops at its next step: World.step_done)
                            results[n].append(run_one(problem, setup, run, fastest, sim.race))
                            if progress is not None:
                                progress(done, total, run, results[n][-1])
                            done += 1
                        mine[strategy.token] = figures(results[n][-setup.repeats:], setup.max_steps).median_seconds
                        fastest = min(fastest, mine[strategy.token])
                    medians[scenario.token] = mine
    except Stopped as e:  # a stop signal (the caller's handler: stop_signals.py): what finished is kept
        if run is None or done == total:
            raise
        raise Interrupted(problem, results, done, total, run, e.signame) from None
    return problem, results


@contextlib.contextmanager
def _threads(given: Optional[int]):
    """torch threads for the simulation's updates: --threads, else half the cores. Its many small element-wise
    ops (an update, a version's copy) run several times slower split over threads that other processes keep
    waiting (the figure: benchmarks/README.md, "Figures behind the code"). Gradients and evaluations take every
    core (``World``'s :class:`~phalanx.simulate.gradients.Gradients`)."""
    from ..launcher import available_cores

    before = torch.get_num_threads()
    torch.set_num_threads(given or max(1, available_cores() // 2))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def print_progress(i: int, total: int, run: SimRun, result) -> None:
    if result.reached:
        outcome = f"reached the target at step {result.steps_to_target} ({result.seconds_to_target:.3g} s simulated)"
    elif result.stopped_behind is not None:
        outcome = (f"stopped at step {result.steps} ({result.train_seconds:.3g} s simulated), slower than the "
                   f"fastest so far ({result.stopped_behind:.3g} s; best {result.metric} {_number(result.best)})")
    else:
        outcome = f"not reached (best {result.metric} {_number(result.best)})"
    print(f"run {i + 1}/{total}: {run.label}: {outcome}; simulated in {result.wall_seconds:.1f} s",
          file=sys.stderr, flush=True)


def _number(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4g}"


DEFAULT_WORKERS = (8, 64, 256)


@dataclasses.dataclass
class SimulatedComparison:
    """What ``phalanx.compare(..., simulate=True)`` returns; ``save(dir)`` writes what ``--out`` writes."""

    setup: runner.Setup  #: marked simulated
    problem: Problem
    runs: dict[int, list[RunResult]]  #: worker count -> every simulated run
    #: worker count -> scenario -> one ranked row per strategy (the worker counts that finished)
    table: dict[int, dict[str, list[Figures]]]
    command: Optional[str] = None
    incomplete: Optional[dict] = None  #: stopped by a signal: by which, during which run

    @property
    def answer(self) -> str:
        if not self.table:
            return "Simulated: no worker count finished."
        return "Simulated: " + " ".join(report.crossover(self.setup, self.table))

    @property
    def tables(self) -> str:
        return report.terminal(self.setup, self.table)

    def __str__(self) -> str:
        return f"{self.tables}\n\n{self.answer}"

    def save(self, out) -> list:
        """report.md and report.json (the scaling report), the scaling plot, and one real-comparison report
        per worker count in ``workers-N/``; returns the top-level report.md's path first."""
        out = Path(out)
        writable(out)
        return report.write(out, self.setup, self.problem, self.runs, self.table, self.command, self.incomplete)


def compare_simulated(options, train, sim, workers: Optional[tuple[int, ...]], command: Optional[str],
                      objects: Optional[dict] = None) -> SimulatedComparison:
    """``phalanx compare --simulate``: check, simulate every run, print the tables and the answer, write the report."""
    if options.strategies is None:
        options = dataclasses.replace(options, strategies=default_strategies(real_defaults(train)))
    setup = dataclasses.replace(setup_from(options, train, objects), simulated=True)
    workers = tuple(workers or DEFAULT_WORKERS)
    check(setup, workers)
    total = count(setup, workers)
    print(f"phalanx compare --simulate: {len(setup.strategies)} strategies x {len(setup.scenarios)} scenarios x "
          f"{setup.repeats} repeats x {len(workers)} worker counts ({', '.join(map(str, workers))}) = {total} "
          f"simulated runs, each to {target_words(setup.target)} or {setup.max_steps} steps (evaluated every "
          f"{setup.eval_every}{'; a run stops once slower than the fastest so far' if sim.race else ''}); "
          f"{setup.task.model_name} on {setup.task.data_name}", flush=True)
    out = report_folder(options.out)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    interrupted: Optional[Interrupted] = None
    with taken_between_steps():
        try:
            problem, results = simulate_compare(setup, workers, sim, say, print_progress)
        except Interrupted as e:  # what finished is still worth a report, marked incomplete
            interrupted, problem, results = e, e.problem, {n: runs for n, runs in e.by_workers.items() if runs}
    finished = {n: runs for n, runs in results.items() if len(runs) == total // len(workers)}
    result = SimulatedComparison(setup, problem, results, report.tables(setup, finished), command,
                                 None if interrupted is None else interrupted.incomplete())
    for note in problem.clock_notes:
        print(f"clock: {note}")
    if finished:
        print("\n" + result.tables + "\n")
        print(result.answer)
    written: list[Path] = []
    if out is not None and results:
        written = result.save(out)
        plot = f"; plot {out / report.SCALING_PLOT}" if finished else ""
        print(f"\nreport {written[0]}, {written[1].name}{plot}; one report per worker count in {out}/workers-N/")
    if interrupted is not None:
        where = (f"the partial report of the {len(interrupted.finished)} finished run(s), marked incomplete: "
                 f"{written[0]}" if written else "no report was written (no --out, or no run finished); the tables "
                 "above hold the worker counts that finished")
        raise Stopped(f"compare --simulate {interrupted.describe()}; {where}", interrupted.signame)
    return result
