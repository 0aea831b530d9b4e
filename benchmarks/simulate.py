"""Is ``phalanx compare --simulate`` right where it can be checked, and fast where it cannot?

Two parts, each printed with medians and saved with the machine:

1. **validation at W = 2 and 3** (``--validate-workers``): the same comparison run for real
   (``Trainer`` runs, real gloo workers) and simulated (the compute and the link measured here, as
   ``phalanx estimate`` measures them), every simulated strategy and scenario ``--repeats`` times;
   per (workers, scenario, strategy) the median steps to target and the median time to target of
   each, and simulated / real. The issue's goal: steps within ±20%, time within ±25%. With
   ``--noise-floor`` the real runs run twice and the clock is also measured before them: the second
   real runs against the first, judged by the same goals, say how far the same runs move by
   themselves a minute later, and the two clocks how far its figures do.
2. **scale**: ``--scale-workers`` (256) simulated workers x every simulated strategy x scenarios, one
   repeat each, with ``--step-time`` and a given link (the target machine's figures): the wall time
   of each simulated run and of the whole, and the peak memory of this process.

    python3 benchmarks/simulate.py                                   # validation (3 repeats) and 256 workers
    python3 benchmarks/simulate.py --repeats 1 --scale-steps 40      # a quick look
    python3 benchmarks/simulate.py --skip-scale --noise-floor        # validation beside its noise floor
    cd examples && PYTHONPATH=. python3 ../benchmarks/simulate.py --model gpt:make --data gpt:load \
        --training-step gpt:step --target 'perplexity<=12' --batch-size 8 --name simulate-gpt ...  # a transformer
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from phalanx import TrainConfig
from phalanx.compare.options import CompareOptions
from phalanx.compare.setup import setup_from
from phalanx.compare.results import RunResult
from phalanx.compare.runner import check, run_all
from phalanx.estimate.overhead import FIGURES
from phalanx.compare.simulated import beside, simulate_compare, target_config
from phalanx.compare.simulated_problem import build_problem
from phalanx.simulate.options import SimulateOptions

from _common import parser, save_result

GOALS = {"steps": 0.20, "seconds": 0.25}


def setup(strategies: str, scenarios: str, repeats: int, max_steps: int, eval_every: int, target: str,
          batch_size: int, task: dict, workers: int = 2):
    """``task``: the run's --model, --data and --training-step (built-in names or import paths)."""
    train = TrainConfig(**task, devices="cpu", workers=workers, batch_size=batch_size)
    options = CompareOptions(strategies=strategies, scenarios=scenarios, repeats=repeats, max_steps=max_steps,
                             eval_every=eval_every, target=target)
    return setup_from(options, train)


def medians(runs: list[RunResult]) -> dict[tuple[str, str], dict]:
    """(scenario, strategy) -> median steps and seconds to target over the repeats that reached it."""
    out: dict[tuple[str, str], dict] = {}
    for key in sorted({(r.scenario, r.strategy) for r in runs}):
        mine = [r for r in runs if (r.scenario, r.strategy) == key and r.reached]
        out[key] = {"reached": len(mine), "runs": sum((r.scenario, r.strategy) == key for r in runs),
                    "steps": statistics.median(r.steps_to_target for r in mine) if mine else None,
                    "seconds": statistics.median(r.seconds_to_target for r in mine) if mine else None,
                    "each": [[r.steps_to_target, r.seconds_to_target] for r in mine]}
    return out


def ratios(row: dict, a: dict, b: dict, name: str) -> None:
    """``row[f"{what}_{name}"]``: b's median over a's, for steps and seconds (None where either reached nothing)."""
    for what in ("steps", "seconds"):
        x, y = a[what], b[what]
        row[f"{what}_{name}"] = y / x if x and y else None


def within(rows: list[dict], name: str) -> dict[str, list[int]]:
    """How many rows' ratio ``name`` meets each goal: {what: [within, of]}."""
    out = {}
    for what, goal in GOALS.items():
        seen = [abs(row[f"{what}_{name}"] - 1) <= goal for row in rows if row.get(f"{what}_{name}") is not None]
        out[what] = [sum(seen), len(seen)]
    return out


def clock_figures(compute) -> dict:
    """The measured figures the simulated clock is made of (seconds), to see how far they move between two
    measurements."""
    return {"step": compute.step, **{k: getattr(compute, k) for k in FIGURES}}


def validate(args) -> dict:
    out = {"rows": [], "clock": {}, "clock_figures": {}, "real_wall_s": 0.0, "simulated_wall_s": 0.0}
    for n in (int(w) for w in args.validate_workers.split(",")):
        rows, clock, figures, real_wall, sim_wall = validate_at(args, n)
        out["rows"] += rows
        out["clock"][n] = clock
        out["clock_figures"][n] = figures
        out["real_wall_s"] += real_wall
        out["simulated_wall_s"] += sim_wall
    rows = out["rows"]
    again = args.noise_floor
    print(f"\n{'W':>2} {'scenario':<12} {'strategy':<12} {'real steps':>10} {'sim steps':>10} {'ratio':>6}   "
          f"{'real s':>7} {'sim s':>7} {'ratio':>6}" + (f"   {'again s':>7} {'ratio':>6}" if again else ""))
    fmt = lambda v, f: f"{v:{f}}" if v is not None else "-"  # noqa: E731
    for row in rows:
        r, m = row["real"], row["simulated"]
        line = (f"{row['workers']:>2} {row['scenario']:<12} {row['strategy']:<12} {fmt(r['steps'], '10.0f')} "
                f"{fmt(m['steps'], '10.0f')} {fmt(row['steps_ratio'], '6.2f')}   {fmt(r['seconds'], '7.2f')} "
                f"{fmt(m['seconds'], '7.2f')} {fmt(row['seconds_ratio'], '6.2f')}")
        if again:
            line += f"   {fmt(row['again']['seconds'], '7.2f')} {fmt(row['seconds_again'], '6.2f')}"
        print(line)
    out["within"] = within(rows, "ratio")
    print(f"simulated within goal: steps {'/'.join(map(str, out['within']['steps']))} (±20%), time "
          f"{'/'.join(map(str, out['within']['seconds']))} (±25%); real runs took {out['real_wall_s']:.0f} s, "
          f"the simulation {out['simulated_wall_s']:.0f} s (its measurements included)")
    if again:
        out["within_again"] = within(rows, "again")
        print(f"the real runs again, against the first (the noise floor: the same runs a minute later): steps "
              f"{'/'.join(map(str, out['within_again']['steps']))} within ±20%, time "
              f"{'/'.join(map(str, out['within_again']['seconds']))} within ±25%")
    for n, figures in out["clock_figures"].items():
        before, after = figures["before"], figures["after"]
        if before:
            moved = ", ".join(f"{k} {before[k] * 1e3:.3g} -> {after[k] * 1e3:.3g} ms"
                              for k in after if after[k] or before[k])
            print(f"the clock at {n} workers, measured before the real runs and by the simulation after them: {moved}")
    return out


def validate_at(args, workers: int) -> tuple[list[dict], list[str], dict, float, float]:
    """One worker count: every real run (twice with --noise-floor), then every simulated one; the rows of medians."""
    s = setup(args.strategies, args.scenarios, args.repeats, args.max_steps, args.eval_every, args.target,
              args.batch_size, task_of(args), workers)
    print(f"validation at {workers} workers: {args.strategies} under {args.scenarios}, {args.repeats} repeats, "
          f"{args.model}, target {args.target}", flush=True)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    before = None
    if args.noise_floor:  # the clock as the simulation measures it, a measurement before the real runs
        early = build_problem(target_config(s), (workers,), workers, None, None, say, s.task, beside(s, (workers,)))
        before = clock_figures(early.compute)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        real = run_all(s, check(s), Path(tmp))
    again = None
    if args.noise_floor:
        with tempfile.TemporaryDirectory() as tmp:
            again = medians(run_all(s, check(s), Path(tmp)))
    real_wall = time.perf_counter() - began
    began = time.perf_counter()
    # compute and link measured here, as the estimate measures them, with the W processes per machine the real
    # runs had (3 workers share these 2 cores: their steps are measured that way)
    sim = SimulateOptions(simulate=True, per_node=workers)
    problem, simulated = simulate_compare(dataclasses.replace(s, simulated=True), (workers,), sim, say)
    sim_wall = time.perf_counter() - began
    r, m = medians(real), medians(simulated[workers])
    rows = []
    for key in r:
        row = {"workers": workers, "scenario": key[0], "strategy": key[1], "real": r[key], "simulated": m[key]}
        ratios(row, r[key], m[key], "ratio")
        if again is not None:
            row["again"] = again[key]
            ratios(row, r[key], again[key], "again")
        rows.append(row)
    figures = {"before": before, "after": clock_figures(problem.compute)}
    return rows, list(problem.clock_notes), figures, real_wall, sim_wall


def task_of(args) -> dict:
    return {"model": args.model, "data": args.data, "training_step": args.training_step}


def scale(args) -> dict:
    n = args.scale_workers
    s = setup(args.scale_strategies, args.scale_scenarios, 1, args.scale_steps, args.scale_eval_every, args.target,
              args.scale_batch_size, task_of(args))
    s = dataclasses.replace(s, simulated=True)
    sim = SimulateOptions(simulate=True, step_time=args.step_time, link_bandwidth=args.link_bandwidth,
                          link_latency=args.link_latency)
    print(f"\nscale: {n} workers x {args.scale_strategies} x {args.scale_scenarios}, batch {args.scale_batch_size} "
          f"per worker, up to {args.scale_steps} steps", flush=True)
    walls = []

    def progress(i, total, run, result):
        walls.append({"strategy": run.strategy.token, "scenario": run.scenario.token, "wall_s": result.wall_seconds,
                      "reached": result.reached, "steps": result.steps, "simulated_s": result.train_seconds,
                      "best_accuracy": result.best_accuracy})
        print(f"  {run.scenario.token:<14} {run.strategy.token:<12} {result.wall_seconds:7.1f} s wall, "
              f"{'reached at step ' + str(result.steps_to_target) if result.reached else 'not reached'} "
              f"({result.train_seconds:.3g} s simulated)", flush=True)

    began = time.perf_counter()
    simulate_compare(s, (n,), sim, lambda line: None, progress)
    total = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux -> GiB
    print(f"{len(walls)} runs of {n} workers simulated in {total:.0f} s "
          f"(median {statistics.median(w['wall_s'] for w in walls):.1f} s "
          f"a run); peak memory of this process {peak:.2f} GiB")
    return {"workers": n, "runs": walls, "total_wall_s": total, "peak_memory_gib": peak}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", default="mlp")
    p.add_argument("--data", default="digits")
    p.add_argument("--training-step", default=None)
    p.add_argument("--name", default="simulate", help="the result's name (benchmarks/results/NAME-<machine>.json)")
    p.add_argument("--validate-workers", default="2,3")
    p.add_argument("--strategies", default="sync,ps,ssp:2,backup:1,local-sgd:8,diloco:8")
    p.add_argument("--scenarios", default="none,slow:1:2,pauses:0.1:4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--target", default="0.95", help="accuracy, or METRIC<=X / METRIC>=X (perplexity<=12)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--scale-workers", type=int, default=256)
    p.add_argument("--scale-strategies", default="sync,ps,ssp:2,backup:8,local-sgd:8,diloco:8")
    p.add_argument("--scale-scenarios", default="none,slow:1:2,pauses:0.1:4")
    p.add_argument("--scale-steps", type=int, default=100)
    p.add_argument("--scale-eval-every", type=int, default=10)
    p.add_argument("--scale-batch-size", type=int, default=4)
    p.add_argument("--step-time", type=float, default=0.010)
    p.add_argument("--link-bandwidth", type=float, default=1.25e9, help="bytes/s (default 10 Gb/s)")
    p.add_argument("--link-latency", type=float, default=20e-6)
    p.add_argument("--noise-floor", action="store_true",
                   help="run the real runs twice and measure the clock before them too: how far real runs and the "
                        "clock move by themselves")
    p.add_argument("--skip-validation", action="store_true")
    p.add_argument("--skip-scale", action="store_true")
    args = p.parse_args()
    validation = None if args.skip_validation else validate(args)
    scaled = None if args.skip_scale else scale(args)
    save_result(args.name, args, validation=validation, scale=scaled)


if __name__ == "__main__":
    main()
