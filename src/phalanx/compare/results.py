"""What one run measured, read back from its metrics file; and the figures of a strategy over its repeats.

A run's figures come from the JSON-lines metrics file its training loop wrote (rank 0's), so the
report can always be checked against the files:

- the *eval* events: step, the test metrics (``metrics``; ``accuracy`` in older files),
  ``train_seconds`` (training time so far, evaluation excluded) and, for the parameter-server family,
  the gradients applied so far;
- the *summary* event: steps, final accuracy, training and evaluation seconds, throughput,
  staleness, gradients applied and dropped;
- the *straggle* event: each rank's calibrated compute time;
- the *link* event (``link:RATE`` scenarios): the bytes that crossed the shaped link, per step.

Bytes on the wire are the summary's: what every rank sent in the training steps, priced by the
collectives' algorithms (``wire.py``), per step; bytes to target are that per step x the steps to
target (a DiLoCo round's bytes fall on its sync steps: exact to within one round).

Time to target is the training time at the first evaluation whose target metric reached the target
(evaluations every ``--eval-every`` steps: the time is that coarse). Examples to target count the
examples in the updates applied by then: steps x global batch, or, where the server reports them,
gradients applied x batch (a ``backup`` update averages W - B gradients, not W). Throughput counts
every example a worker computed a gradient on (dropped ones included) per second of training.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any, Optional, Union

from ..task.metrics import Target, parse_target


@dataclasses.dataclass
class RunResult:
    strategy: str  #: the token: "ssp:2"
    scenario: str  #: "slow:1:2"
    repeat: int  #: 0-based
    seed: int
    reached: bool
    diverged: bool  #: stopped by the NaN guard (it never reaches the target)
    steps_to_target: Optional[int]
    seconds_to_target: Optional[float]  #: training time (evaluation and start-up excluded)
    examples_to_target: Optional[int]
    best_accuracy: Optional[float]  #: None where the run reported no accuracy (a task with another metric)
    final_accuracy: Optional[float]
    steps: int
    train_seconds: float
    eval_seconds: float
    wall_seconds: float  #: the whole run, worker start-up included
    startup_seconds: float  #: wall - training - evaluation: start-up, calibration, the final checkpoint
    examples_per_sec: float
    staleness: Optional[dict[str, Any]]  #: mean, p95, max, histogram (strategies that have one)
    dropped: Optional[dict[str, Any]]  #: total, of (gradients pushed), by_worker (the parameter-server family)
    calibrated_compute_s: dict[str, float]  #: rank -> seconds (where a straggler scenario calibrated)
    curve: list[dict[str, Optional[float]]]  #: every evaluation: step, seconds (training time), the target's metric
    metrics: str  #: the metrics file it was read from
    link_bytes: Optional[int] = None  #: link:RATE: what crossed the shaped loopback (its kernel counters)
    link_bytes_per_step: Optional[float] = None
    metric: str = "accuracy"  #: the target's metric: best and final are its values
    higher: bool = True  #: higher is better for it
    best: Optional[float] = None  #: its best value at any evaluation
    final: Optional[float] = None  #: its value at the end
    wire_bytes_per_step: Optional[float] = None  #: what every rank sent per training step (the summary's)
    wire_bytes_to_target: Optional[float] = None
    #: ``compare --simulate``'s race stopped it without the target, its clock past this time: the fastest median
    #: time to target found before it (so it could not be first)
    stopped_behind: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_events(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def value_of(event: dict[str, Any], metric: str) -> Optional[float]:
    """A metric's value in an eval event (or a summary): under ``metrics`` (``accuracy`` in older files)."""
    found = event.get("metrics") or event.get("test_metrics") or {}
    if metric in found:
        return found[metric]
    return event.get("accuracy", event.get("test_accuracy")) if metric == "accuracy" else None


def from_events(events: list[dict[str, Any]], *, strategy: str, scenario: str, repeat: int, seed: int,
                target: Union[float, str, Target], batch_size: int, global_batch: int, wall_seconds: float,
                metrics: str, diverged: bool = False) -> RunResult:
    """The figures of one run, from its metrics events; ``target``: a Target, or an accuracy."""
    target = parse_target(target, "--target")
    evals = [e for e in events if e["event"] == "eval"]
    summary = next((e for e in reversed(events) if e["event"] == "summary"), None) or _diverged(events, evals)
    straggle = next((e for e in events if e["event"] == "straggle"), {})
    link: dict[str, Any] = next((e for e in reversed(events) if e["event"] == "link"), {})
    first = next((e for e in evals if _reached(target, value_of(e, target.metric))), None)
    seen = [v for v in (value_of(e, target.metric) for e in evals) if v is not None]
    final = value_of(summary, target.metric)
    best = (max if target.higher else min)(seen, default=final)
    train, evaluation = summary["train_seconds"], summary["eval_seconds"]
    per_step = summary.get("wire_bytes_per_step")
    return RunResult(
        strategy=strategy, scenario=scenario, repeat=repeat, seed=seed, reached=first is not None, diverged=diverged,
        steps_to_target=first["step"] if first else None,
        seconds_to_target=first["train_seconds"] if first else None,
        examples_to_target=_examples_applied(first, batch_size, global_batch) if first else None,
        best_accuracy=max((e["accuracy"] for e in evals if "accuracy" in e), default=summary.get("test_accuracy")),
        final_accuracy=summary.get("test_accuracy"), steps=summary["steps"], train_seconds=train,
        eval_seconds=evaluation, wall_seconds=wall_seconds,
        startup_seconds=max(wall_seconds - train - evaluation, 0.0),
        examples_per_sec=_examples_computed(summary, batch_size) / max(train, 1e-9) if "gradients_applied_total"
        in summary else summary["examples_per_sec"],
        staleness=_staleness(summary), dropped=_dropped(summary),
        calibrated_compute_s=straggle.get("calibrated_compute_s", {}),
        curve=[{"step": e["step"], "seconds": e["train_seconds"], target.metric: value_of(e, target.metric)}
               for e in evals],
        metrics=metrics, link_bytes=link.get("link_bytes"), link_bytes_per_step=link.get("link_bytes_per_step"),
        metric=target.metric, higher=target.higher, best=best, final=final,
        wire_bytes_per_step=per_step,
        wire_bytes_to_target=per_step * first["step"] if first is not None and per_step is not None else None,
    )


def _reached(target: Target, value: Optional[float]) -> bool:
    """An evaluation that did not report the target's metric has not reached it."""
    return value is not None and target.reached({target.metric: value})


def _diverged(events: list[dict[str, Any]], evals: list[dict[str, Any]]) -> dict[str, Any]:
    """A run the NaN guard stopped writes no summary: what its last events say instead."""
    stop = next(e for e in reversed(events) if e["event"] == "diverged")
    steps = [e for e in events if e["event"] == "step"]
    return {"steps": stop["step"], "test_accuracy": evals[-1].get("accuracy") if evals else None,
            "test_metrics": evals[-1].get("metrics") if evals else None,
            "train_seconds": evals[-1]["train_seconds"] if evals else 0.0,
            "eval_seconds": sum(e["eval_seconds"] for e in evals),
            "examples_per_sec": steps[-1]["examples_per_sec"] if steps else 0.0}


def _examples_applied(event: dict[str, Any], batch_size: int, global_batch: int) -> int:
    if "gradients_applied_total" in event:  # the parameter-server family counts what it applied
        return int(event["gradients_applied_total"]) * batch_size
    return int(event["step"]) * global_batch


def _examples_computed(summary: dict[str, Any], batch_size: int) -> int:
    return (int(summary["gradients_applied_total"]) + int(summary.get("gradients_dropped_total", 0))) * batch_size


def _staleness(summary: dict[str, Any]) -> Optional[dict[str, Any]]:
    if "staleness_histogram" not in summary:
        return None
    return {"mean": summary["staleness_mean"], "p95": summary["staleness_p95"], "max": summary["staleness_max"],
            "histogram": summary["staleness_histogram"]}


def _dropped(summary: dict[str, Any]) -> Optional[dict[str, Any]]:
    if "gradients_dropped_total" not in summary:
        return None
    total = int(summary["gradients_dropped_total"])
    return {"total": total, "of": int(summary["gradients_applied_total"]) + total,
            "by_worker": summary.get("gradients_dropped", {})}


# --------------------------------------------------------------------------- one strategy, its repeats


@dataclasses.dataclass
class Figures:
    """One strategy in one scenario, over its repeats (medians and spread)."""

    strategy: str
    scenario: str
    runs: int
    reached: int  #: repeats that reached the target
    seconds: list[float]  #: time to target of each repeat that reached it
    median_seconds: float  #: math.inf unless at least half the repeats reached the target
    median_steps: Optional[float]
    median_examples: Optional[float]
    examples_per_sec: float  #: median
    best_accuracy: Optional[float]  #: the best accuracy any repeat reached (None: not reported)
    max_steps: int
    staleness_mean: Optional[float]
    dropped_fraction: Optional[float]
    bytes_per_step: Optional[float] = None  #: median bytes on the wire per step (None: not known)
    bytes_to_target: Optional[float] = None  #: median over the repeats that reached the target
    ratio: Optional[float] = None  #: median time / the baseline's (None: either not reached)
    winner: bool = False
    metric: str = "accuracy"  #: the target's metric
    best: Optional[float] = None  #: its best value any repeat reached (the highest, or the lowest)
    #: the race stopped enough repeats that the median is not known: it is above this time (the fastest's)
    behind: Optional[float] = None

    @property
    def any_reached(self) -> bool:
        return self.reached > 0

    @property
    def best_value(self) -> Optional[float]:
        """The target metric's best (a result built without metrics, e.g. a simulated one, has its accuracy)."""
        return self.best if self.best is not None else self.best_accuracy

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["median_seconds"] = None if math.isinf(self.median_seconds) else self.median_seconds
        return out


def figures(runs: list[RunResult], max_steps: int) -> Figures:
    """Medians over the repeats of one (scenario, strategy); a repeat that missed the target counts as
    infinitely slow, so the median is finite only if at least half of them reached it. A repeat the race
    stopped counts so too: its time is above the bound it was stopped at, which the figures keep."""
    reached = [r for r in runs if r.reached]
    times = sorted(r.seconds_to_target for r in reached if r.seconds_to_target is not None)
    padded = times + [math.inf] * (len(runs) - len(reached))
    staleness = [r.staleness["mean"] for r in runs if r.staleness]
    dropped = [r.dropped for r in runs if r.dropped]
    per_step = [r.wire_bytes_per_step for r in runs if r.wire_bytes_per_step is not None]
    to_target = [r.wire_bytes_to_target for r in reached if r.wire_bytes_to_target is not None]
    median = statistics.median(padded)
    stopped = [r.stopped_behind for r in runs if r.stopped_behind is not None]
    return Figures(
        strategy=runs[0].strategy, scenario=runs[0].scenario, runs=len(runs), reached=len(reached),
        seconds=times, median_seconds=median, behind=min(stopped) if stopped and math.isinf(median) else None,
        median_steps=_median([r.steps_to_target for r in reached]),
        median_examples=_median([r.examples_to_target for r in reached]),
        examples_per_sec=statistics.median(r.examples_per_sec for r in runs),
        best_accuracy=max((r.best_accuracy for r in runs if r.best_accuracy is not None), default=None),
        max_steps=max_steps, metric=runs[0].metric,
        best=_best([r.best if r.best is not None else r.best_accuracy for r in runs], runs[0].higher),
        staleness_mean=statistics.mean(staleness) if staleness else None,
        dropped_fraction=sum(d["total"] for d in dropped) / max(sum(d["of"] for d in dropped), 1) if dropped
        else None,
        bytes_per_step=statistics.median(per_step) if per_step else None,
        bytes_to_target=statistics.median(to_target) if to_target else None,
    )


def _median(values: list[Optional[int]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _best(values: list[Optional[float]], higher: bool) -> Optional[float]:
    known = [v for v in values if v is not None and not math.isnan(v)]
    return (max if higher else min)(known) if known else None


def rank(table: list[Figures], baseline: str) -> list[Figures]:
    """Mark the winner (the lowest finite median time) and each strategy's ratio to the baseline's time."""
    base = next((f for f in table if f.strategy == baseline), None)
    finite = [f for f in table if not math.isinf(f.median_seconds)]
    best = min(finite, key=lambda f: f.median_seconds) if finite else None
    for f in table:
        f.winner = f is best
        if base is not None and not math.isinf(base.median_seconds) and not math.isinf(f.median_seconds):
            f.ratio = f.median_seconds / base.median_seconds
    return table
