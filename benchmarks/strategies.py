"""Throughput of every data-parallel strategy, with and without a straggler, side by side.

sync, ps, ssp (K = 1, 4), hogwild and local-sgd train the same model on the same data with the
same workers; every variant runs once per repeat, interleaved, with and without
``--straggler 1:2`` (rank 1 takes twice as long per step). Throughput is the training loop's
global examples per second (worker start-up excluded); staleness comes from the run's summary.
For ps/ssp, rank 1 is the first worker (rank 0 is the server).

    python3 benchmarks/strategies.py [--repeats 3 --steps 200 --model cnn --batch-size 64]
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from phalanx import TrainConfig, Trainer
from phalanx.strategies import SSP, Hogwild, LocalSGD, ParameterServer, Sync

from _common import parser, save_result

VARIANTS = {
    "sync": Sync, "ps": ParameterServer, "ssp(1)": lambda: SSP(staleness=1), "ssp(4)": lambda: SSP(staleness=4),
    "hogwild": Hogwild, "local-sgd(8)": lambda: LocalSGD(sync_every=8),
}


def run(strategy, args, straggler) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(strategy=strategy(), workers=2, devices="cpu", model=args.model, steps=args.steps,
                          batch_size=args.batch_size, progress="none", checkpoint_dir=tmp, checkpoint_every=0,
                          log_every=args.steps, straggler=straggler)
        summary = Trainer(cfg).fit()
        events = [json.loads(line) for line in Path(cfg.metrics).read_text().splitlines()]
    return {"examples_per_sec": summary["examples_per_sec"], "accuracy": summary["test_accuracy"],
            **{k: v for k, v in events[-1].items() if k.startswith("staleness_") and k != "staleness_histogram"}}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--model", default="cnn")
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()

    results: dict = {s: {v: [] for v in VARIANTS} for s in ("none", "1:2")}
    for r in range(args.repeats):
        for straggler in ("none", "1:2"):
            for name, strategy in VARIANTS.items():
                out = run(strategy, args, None if straggler == "none" else straggler)
                results[straggler][name].append(out)
                print(f"repeat {r + 1}/{args.repeats} straggler {straggler:<4} {name:<13} "
                      f"{out['examples_per_sec']:8.1f} examples/sec", flush=True)

    report: dict = {}
    for straggler, by_variant in results.items():
        sync = statistics.median(x["examples_per_sec"] for x in by_variant["sync"])
        print(f"\nstraggler {straggler}: {args.model}, {args.batch_size} per worker, 2 workers, {args.steps} steps, "
              f"median of {args.repeats} (min-max), ratio to sync")
        for name, runs in by_variant.items():
            rates = [x["examples_per_sec"] for x in runs]
            med = statistics.median(rates)
            stale = ""
            if "staleness_mean" in runs[-1]:
                stale = (f"  staleness mean {statistics.median(x['staleness_mean'] for x in runs):.1f}, "
                         f"max {max(x['staleness_max'] for x in runs)}")
            print(f"  {name:<13} {med:8.1f} ({min(rates):.1f}-{max(rates):.1f})  x{med / sync:.2f}  "
                  f"accuracy {statistics.median(x['accuracy'] for x in runs):.3f}{stale}")
            report.setdefault(straggler, {})[name] = {"runs": runs, "median_examples_per_sec": med,
                                                     "ratio_to_sync": med / sync}
    save_result("strategies", args, results=report)


if __name__ == "__main__":
    main()
