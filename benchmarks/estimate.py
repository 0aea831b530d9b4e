"""How far is ``phalanx estimate`` from what ``phalanx train`` measures? Predicted vs measured step time.

Two models: the digits ``cnn`` (151 k parameters: latency-bound, its gradients are one small
message) and a 20.1 M-parameter ``mlp`` on synthetic 1x280x280 inputs (bandwidth-bound: 80 MB of
gradients per step). For each, and each worker count, every round first runs the estimate (compute
measured under the workers' conditions, the link measured with ``--measure-link``, all workers on
this machine: ``--per-node N``), then trains with ``sync``, ``ps``, ``local-sgd`` and ``pipeline``
(the order rotates from round to round). A run's step time is the mean ``sec_per_batch`` of its
metrics file's log intervals (of equal steps), the first (warm-up) interval left out. The figure judged is, per
model, worker count and strategy, the median prediction over rounds against the median measured
step: the goal is every error within ±15%. Beside it, from the same measurements, the prediction
without the costs measured beyond compute and bytes (``estimate/overhead.py``: the model's DDP step
over its bare step, the parameters' all-reduce after a real step, the parameter server's round trip), so
what they add is judged on the same run.

    python3 benchmarks/estimate.py                     # 3 rounds; 2 workers (and 4 where there are >= 4 cores)
    python3 benchmarks/estimate.py --rounds 1 --cases cnn --cnn-steps 60 --mlp-steps 12   # a quick check
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path

from phalanx import TrainConfig, Trainer
from phalanx.estimate import EstimateOptions
from phalanx.estimate.overhead import FIGURES
from phalanx.estimate.report import describe
from phalanx.estimate.run import run as run_estimate
from phalanx.estimate.setup import conditions_for, prepare
from phalanx.estimate.setup import predict as est_predict
from phalanx.strategies import strategy_class

from _common import parser, save_result

STRATEGIES = ("sync", "ps", "local-sgd", "pipeline")
GOAL = 0.15

CASES = {
    "cnn": {"model": "cnn", "data": "digits", "batch_size": 32},
    "mlp": {"model": "mlp", "data": "synthetic", "synthetic_shape": (1, 280, 280), "synthetic_size": 512,
            "batch_size": 32},
}
LOG_EVERY = {"cnn": 20, "mlp": 5}


def predict(case: str, workers: int, args) -> tuple[dict, dict, dict]:
    """The estimate's step per strategy, the same without the measured fixed costs, and everything it
    measured (kept in the results for diagnosis)."""
    options = EstimateOptions(workers=(workers,), strategy="all", per_node=workers, measure_link=True,
                              measure_steps=args.measure_steps)
    setup = prepare(options, dict(CASES[case], devices="cpu"), {})
    est = run_estimate(setup, lambda line: None)
    text = describe(est).splitlines()
    for line in text[2:text.index("")]:  # what was measured: compute per condition, the links
        print(f"    {line}", flush=True)
    bare = {row.strategy: est_predict(setup, row, dataclasses.replace(
        est.computes[conditions_for(setup, row)], **dict.fromkeys(FIGURES, 0.0)), est.network).step
        for row in setup.rows}
    steps = {p.strategy: p.step for p in est.predictions if p.strategy in STRATEGIES}
    return steps, {s: bare[s] for s in steps}, est.to_dict()


def measure(case: str, strategy: str, workers: int, steps: int) -> float:
    """Mean sec_per_batch of a phalanx train run's log intervals after the first (intervals of equal steps: the
    mean step; a median of intervals would miss local SGD's averaging, which only some intervals hold)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(strategy=strategy_class(strategy)(), workers=workers, devices="cpu", steps=steps,
                          progress="none", checkpoint_dir=tmp, checkpoint_every=0, log_every=LOG_EVERY[case],
                          **CASES[case])
        Trainer(cfg).fit()
        events = [json.loads(line) for line in Path(cfg.metrics).read_text().splitlines()]
    intervals = [e["sec_per_batch"] for e in events if e["event"] == "step"]
    return statistics.mean(intervals[1:] if len(intervals) > 1 else intervals)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", default=None, help="worker counts, e.g. 2,4 (default: 2, and 4 with >= 4 cores)")
    p.add_argument("--cases", default="cnn,mlp")
    p.add_argument("--cnn-steps", type=int, default=300)
    p.add_argument("--mlp-steps", type=int, default=40)
    p.add_argument("--measure-steps", type=int, default=20)
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    workers = [int(w) for w in args.workers.split(",")] if args.workers else ([2, 4] if cores >= 4 else [2])
    cases = args.cases.split(",")
    train_steps = {"cnn": args.cnn_steps, "mlp": args.mlp_steps}

    predicted: dict = {}
    without: dict = {}
    measured: dict = {}
    estimates: list = []
    for r in range(args.rounds):
        for case in cases:
            for n in workers:
                print(f"round {r + 1}/{args.rounds}: {case}, {n} workers: estimate", flush=True)
                steps, bare, details = predict(case, n, args)
                estimates.append({"round": r, "case": case, "workers": n, **details})
                for strategy, step in steps.items():
                    predicted.setdefault((case, n, strategy), []).append(step)
                    without.setdefault((case, n, strategy), []).append(bare[strategy])
                order = STRATEGIES[r % len(STRATEGIES):] + STRATEGIES[:r % len(STRATEGIES)]
                for strategy in order:
                    seconds = measure(case, strategy, n, train_steps[case])
                    measured.setdefault((case, n, strategy), []).append(seconds)
                    print(f"  {strategy:<10} predicted {predicted[(case, n, strategy)][-1] * 1e3:8.2f} ms   measured "
                          f"{seconds * 1e3:8.2f} ms", flush=True)

    print(f"\npredicted vs measured step time (medians of {args.rounds} rounds; goal: every error within "
          f"±{GOAL:.0%})")
    rows, worst = [], 0.0
    for (case, n, strategy), runs in measured.items():
        pred = statistics.median(predicted[(case, n, strategy)])
        meas = statistics.median(runs)
        error = pred / meas - 1
        bare = statistics.median(without[(case, n, strategy)])
        worst = max(worst, abs(error))
        print(f"  {case:<4} {n} workers {strategy:<10} predicted {pred * 1e3:8.2f} ms   measured {meas * 1e3:8.2f} ms "
              f"({min(runs) * 1e3:.2f}-{max(runs) * 1e3:.2f})   error {error:+6.1%}  "
              f"{'ok' if abs(error) <= GOAL else 'OUTSIDE the goal'}   (without the fixed costs: "
              f"{bare * 1e3:.2f} ms, {bare / meas - 1:+.1%})")
        rows.append({"case": case, "workers": n, "strategy": strategy, "predicted_s": pred, "measured_s": meas,
                     "predicted_without_fixed_s": bare, "error_without_fixed": bare / meas - 1,
                     "predicted_runs_s": predicted[(case, n, strategy)], "measured_runs_s": runs, "error": error})
    print(f"largest error {worst:.1%} (goal ±{GOAL:.0%}): {'met' if worst <= GOAL else 'not met'}")
    save_result("estimate", args, workers=workers, goal=GOAL, largest_error=worst, results=rows,
                estimates=estimates)


if __name__ == "__main__":
    main()
