"""--loader-workers: batches per second from a lazy Dataset whose items take time to load, 0 vs N workers.

A Dataset's ``__getitem__`` that waits on storage (a sleep of --item-ms per item stands in for a read
from disk) bounds a rank's input rate at batch / (batch x item time) with 0 loader workers (the items
are read in the rank, one after the other); N DataLoader workers read N batches at once. Each variant
reads the same plan of one rank's shard (ShardedBatches over a LazyExamples, as a training run does)
after a warm-up (the loader's fork server started, its workers forked); the variants are interleaved.

    python3 benchmarks/loader_workers.py [--repeats 5 --batches 20 --batch 32 --item-ms 1 --workers 2]
"""

from __future__ import annotations

import time

import torch

from phalanx.data import ShardedBatches
from phalanx.data.lazy import LazyExamples

from _common import parser, print_medians, save_result


class SlowItems(torch.utils.data.Dataset):
    """Items that take ``ms`` milliseconds each to load, like a read from storage."""

    def __init__(self, n: int, ms: float):
        self.n, self.ms = n, ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.ms / 1000)
        return torch.full((64,), float(i)), i % 10


def batches_per_second(data: LazyExamples, batch: int, count: int) -> float:
    reader = ShardedBatches(data, batch, rank=0, world_size=2, seed=0)(0)
    next(reader)  # warm-up: the loader's workers are up
    start = time.perf_counter()
    for _ in range(count):
        next(reader)
    seconds = time.perf_counter() - start
    reader.close()
    return count / seconds


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--item-ms", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    dataset = SlowItems(args.batch * 2 * (args.batches + 2), args.item_ms)
    variants = {"0 loader workers": 0, f"{args.workers} loader workers": args.workers}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, workers in variants.items():
            runs[name].append(batches_per_second(LazyExamples(dataset, workers, "bench"), args.batch, args.batches))
    print(f"batches/s of {args.batch} items at {args.item_ms:g} ms each (median, min-max of {args.repeats}):")
    med = print_medians(runs, 18)
    names = list(variants)
    ratio = med[names[1]] / med[names[0]]
    print(f"ratio {names[1]} / {names[0]}: {ratio:.2f}")
    save_result("loader_workers", args, batches_per_second=runs, medians=med, ratio=ratio)


if __name__ == "__main__":
    main()
