"""Is a batch read ahead on a thread (``--prefetch 2``) or in the loop (``--prefetch 0``) faster on CPU?

``phalanx train`` runs at 2 workers on this machine, each variant in turn (interleaved rounds), for
the digits ``mlp`` and ``cnn`` under ``sync`` and ``local-sgd``; a run's figure is its training time
per step (the summary's ``train_seconds`` over its steps). Printed: the medians and the ratio
prefetch 0 / prefetch 2 (below 1: reading in the loop is faster). This decided the CPU default
(``data/loader.prefetch_depth``): on a machine whose cores the workers fill, the thread only
competes with its own worker.

    python3 benchmarks/prefetch.py --save
"""

from __future__ import annotations

import statistics
import tempfile

from phalanx import TrainConfig, Trainer
from phalanx.compare.tokens import parse_strategy

from _common import parser, save_result

DEPTHS = (2, 0)


def step_seconds(model: str, strategy: str, depth: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(model=model, devices="cpu", workers=2, batch_size=32, steps=steps, eval_every=0,
                          log_every=50, strategy=parse_strategy(strategy).options, checkpoint_dir=tmp,
                          metrics=f"{tmp}/metrics.jsonl", progress="none", prefetch=depth)
        summary = Trainer(cfg).fit()
        return summary["train_seconds"] / summary["steps"]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--strategies", default="sync,local-sgd:8")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    rows = []
    for model in args.models.split(","):
        for strategy in args.strategies.split(","):
            runs = {d: [] for d in DEPTHS}
            for _ in range(args.rounds):
                for d in DEPTHS:
                    runs[d].append(step_seconds(model, strategy, d, args.steps))
            med = {d: statistics.median(v) for d, v in runs.items()}
            ratio = med[0] / med[2]
            rows.append({"model": model, "strategy": strategy, "runs_s": {str(d): v for d, v in runs.items()},
                         "median_s": {str(d): m for d, m in med.items()}, "ratio_0_over_2": ratio})
            print(f"{model:4} {strategy:12} prefetch 2: {med[2] * 1e3:7.3f} ms   prefetch 0: {med[0] * 1e3:7.3f} ms "
                  f"  0/2 = {ratio:.3f}", flush=True)
    save_result("prefetch", args, rows=rows)


if __name__ == "__main__":
    main()
