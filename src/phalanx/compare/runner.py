"""Train every strategy to the target under every scenario, interleaved; read back what each measured.

Who runs what: this process (the parent) holds the user's problem as one
:class:`~phalanx.task.Task` (model, data, loss, metrics, optimizer: built once, from the flags or
from what ``phalanx.compare()`` was given) and makes one :class:`~phalanx.train.TrainConfig` per
run from the shared training flags (batch, recipe, devices: the same for every run), the strategy
and the scenario; checks every (strategy, scenario) before the first run starts (a token
that cannot run is one line, nothing trained); then trains the runs one after another through
``Trainer.fit``, each with fresh workers forked by this process's fork server (warm after the first
run: a run's start-up is milliseconds of forking, then its rendezvous; :mod:`phalanx.launcher.forkserver`).
A run stops at the first evaluation that reaches the target (``stop_at``: ``accuracy>=0.95``,
``loss<=0.3``) or after ``max_steps``; its figures are read back from the metrics
file its loop wrote (``results.py``).

Order: within each repeat every scenario runs every strategy, and the strategies' order rotates
from one repeat to the next, so that a drift in the machine's speed (another job, a warming CPU)
hits every strategy alike. Repeat r uses seed + r for every strategy: within a repeat every run
starts from the same weights, reads the data in the same order and meets the same pauses. The data
itself is the Task's, loaded once: every run of every repeat trains and is evaluated on the same
sets (a validation part held out of data without a test set included).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Protocol

from ..errors import PhalanxError, Stopped, TrainingDiverged
from ..launcher.stop_signals import stop_if_asked
from ..train import TrainConfig, Trainer
from ..task.metrics import Target
from ..task import Task
from .results import RunResult, from_events, read_events
from .tokens import Scenario, StrategyToken


@dataclasses.dataclass(frozen=True)
class Setup:
    """One comparison: what every run shares, and what varies."""

    train: TrainConfig  #: the shared training flags (strategy, straggler, steps and observation are set per run)
    task: Task  #: the user's problem, the same for every run (each run's Trainer is built from it)
    strategies: tuple[StrategyToken, ...]
    scenarios: tuple[Scenario, ...]
    target: Target  #: the test metric's value to reach (``accuracy>=0.95``, ``loss<=0.3``)
    repeats: int
    max_steps: int
    eval_every: int
    simulated: bool = False  #: computed by ``phalanx.simulate``, not run: every figure is marked so


@dataclasses.dataclass(frozen=True)
class Run:
    strategy: StrategyToken
    scenario: Scenario
    repeat: int  #: 0-based
    seed: int

    @property
    def label(self) -> str:
        return f"{self.strategy.token} under {self.scenario.token}, repeat {self.repeat + 1}"

    @property
    def directory(self) -> Path:
        """Where its metrics go, under the comparison's output directory."""
        return Path("runs") / self.scenario.token.replace(":", "-") / \
            f"{self.strategy.token.replace(':', '-')}-repeat-{self.repeat + 1}"

    @property
    def board(self) -> Path:
        """Its TensorBoard run under ``--tensorboard DIR``: scenario/strategy-rN, so that one scenario's
        strategies overlay as runs of one folder."""
        strategy = self.strategy.token.replace(":", "-")
        return Path(self.scenario.token.replace(":", "-")) / f"{strategy}-r{self.repeat + 1}"


def schedule(setup: Setup) -> list[Run]:
    """Every run, interleaved: repeats outermost, the strategies' order rotated each repeat."""
    runs = []
    n = len(setup.strategies)
    for repeat in range(setup.repeats):
        order = setup.strategies[repeat % n:] + setup.strategies[:repeat % n]
        for scenario in setup.scenarios:
            runs += [Run(strategy, scenario, repeat, setup.train.seed + repeat) for strategy in order]
    return runs


def config_for(setup: Setup, run: Run, checkpoint_dir: str, metrics: Optional[str] = None) -> TrainConfig:
    """The run's TrainConfig: the shared flags, plus its strategy, its scenario and the stopping rule."""
    return dataclasses.replace(
        setup.train, strategy=run.strategy.options, straggler=run.scenario.slowness, link=run.scenario.link,
        seed=run.seed,
        steps=setup.max_steps, eval_every=setup.eval_every, stop_at=str(setup.target), stop_at_accuracy=None,
        log_every=setup.eval_every, checkpoint_dir=checkpoint_dir, checkpoint_every=0, keep_checkpoints=1,
        metrics=metrics or f"{checkpoint_dir}/metrics.jsonl", progress="silent", resume=None,
        tensorboard=None if setup.train.tensorboard is None else str(Path(setup.train.tensorboard) / run.board),
        overwrite=True)  # a compare run replaces the same run of an earlier compare in the same --out


@dataclasses.dataclass(frozen=True)
class Checked:
    """What the checks learned, per strategy: the global batch and the workers."""

    global_batch: dict[str, int]
    batch_size: int
    workers: int


def check(setup: Setup) -> Checked:
    """Every (strategy, scenario) planned in the parent, before any run: one clear line for the first that fails."""
    global_batch: dict[str, int] = {}
    workers = 0
    with tempfile.TemporaryDirectory(prefix="phalanx-compare-check-") as tmp:
        for strategy in setup.strategies:
            for scenario in setup.scenarios:
                run = Run(strategy, scenario, 0, setup.train.seed)
                try:
                    plan = Trainer(config_for(setup, run, f"{tmp}/checkpoints"), task=setup.task).plan()
                except PhalanxError as e:
                    where = f" under scenario {scenario.token}" if scenario.token != "none" else ""
                    raise PhalanxError(f"{strategy.token}{where}: {e}") from None
                global_batch[strategy.token] = plan.config.batch_size * plan.layout.shards
                workers = plan.workers
    return Checked(global_batch, setup.train.batch_size, workers)


def run_one(setup: Setup, checked: Checked, run: Run, out: Path) -> RunResult:
    """Train one run to the target (or max steps) and read back its figures."""
    directory = out / run.directory
    directory.mkdir(parents=True, exist_ok=True)
    metrics = directory / "metrics.jsonl"
    with tempfile.TemporaryDirectory(prefix="phalanx-compare-") as checkpoints:  # no checkpoint is kept
        began = time.perf_counter()
        diverged = False
        try:
            Trainer(config_for(setup, run, checkpoints, str(metrics)), task=setup.task).fit()
        except TrainingDiverged:
            diverged = True  # an outcome like any other: it never reaches the target
        wall = time.perf_counter() - began
    return from_events(read_events(metrics), strategy=run.strategy.token, scenario=run.scenario.token,
                       repeat=run.repeat, seed=run.seed, target=setup.target, batch_size=checked.batch_size,
                       global_batch=checked.global_batch[run.strategy.token], wall_seconds=wall,
                       metrics=str(run.directory / "metrics.jsonl"), diverged=diverged)


class Labelled(Protocol):
    """A run as :class:`Interrupted` names it: a real :class:`Run`, or a simulated one."""

    @property
    def label(self) -> str: ...


class Interrupted(Exception):
    """SIGINT or SIGTERM during run ``index`` (0-based) of ``total``: ``finished`` holds the runs before it."""

    def __init__(self, finished: list[RunResult], index: int, total: int, run: Labelled, signame: str):
        super().__init__(f"{signame} during run {index + 1}/{total}")
        self.finished, self.index, self.total, self.run, self.signame = finished, index, total, run, signame

    def describe(self) -> str:
        return f"stopped by {self.signame} during run {self.index + 1}/{self.total} ({self.run.label})"

    def incomplete(self) -> dict:
        """What the report's ``incomplete`` holds: the signal, the interrupted run, runs finished of runs planned."""
        return {"stopped_by": self.signame, "interrupted_run": self.index + 1, "interrupted_label": self.run.label,
                "runs_finished": len(self.finished), "runs_planned": self.total}


def run_all(setup: Setup, checked: Checked, out: Path,
            progress: Callable[[int, Run, Optional[RunResult]], None] = lambda i, run, result: None) -> list[RunResult]:
    """Every run in :func:`schedule` order; ``progress(i, run, result)`` before (None) and after each.

    A stop request (the run's workers stopped, or the signal came between runs) raises
    :class:`Interrupted` carrying the runs that finished, so a partial report can be written."""
    results: list[RunResult] = []
    runs = schedule(setup)
    for i, run in enumerate(runs):
        try:
            stop_if_asked()  # a stop signal between runs (compare's handler records it: stop_signals.py)
            progress(i, run, None)
            results.append(run_one(setup, checked, run, out))
            progress(i, run, results[-1])
        except Stopped as e:
            # The signal may come just after a run finished (while its line is printed): the run it
            # interrupted is the first one not finished, never one whose result is in.
            first = len(results)
            if first == len(runs):
                return results  # every run finished: the report is whole
            raise Interrupted(results, first, len(runs), runs[first], e.signame) from None
    return results
