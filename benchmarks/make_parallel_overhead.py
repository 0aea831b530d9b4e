"""make_parallel overhead, side by side in one run.

1. One device: the wrapper (a pass-through) against the bare module; the ratio should be ≥ 0.95.
2. Two CPU towers against one: the speedup, whatever it is. Both towers share this machine's
   cores (and torch's intra-op thread pool), so on a CPU the gain is bounded by how idle the
   cores are while one tower computes.

Each variant does forward + backward + SGD step of the cifar10 network on a batch; variants
are interleaved, each repeat times a fixed number of steps after a warm-up.

    python3 benchmarks/make_parallel_overhead.py [--repeats 7 --steps 10 --batch 64]
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import phalanx
from phalanx.task.models import build_model

from _common import parser, print_medians, save_result


def steps_per_second(model, params, batch: int, steps: int) -> float:
    opt = torch.optim.SGD(params, lr=0.01)
    x = torch.randn(batch, 3, 24, 24)
    y = torch.randint(0, 10, (batch,))
    for _ in range(2):  # warm-up
        F.cross_entropy(model(x), y).backward()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return steps / (time.perf_counter() - start)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()

    torch.manual_seed(0)
    bare = build_model("cifar10", (3, 24, 24), 10)
    variants = {
        "bare module": bare,
        "make_parallel, 1 device": phalanx.make_parallel(bare, "cpu"),
        "make_parallel, 2 CPU towers": phalanx.make_parallel(bare, ["cpu", "cpu"]),
    }
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, model in variants.items():
            runs[name].append(steps_per_second(model, bare.parameters(), args.batch, args.steps) * args.batch)
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{n} {v[-1]:.0f}" for n, v in runs.items()), flush=True)

    print(f"\ncifar10 network, batch {args.batch}, {torch.get_num_threads()} torch threads, "
          f"{args.repeats} repeats of {args.steps} steps (examples/sec: median, min-max)")
    med = print_medians(runs, 28)
    # Ratios of neighbours in the same repeat cancel most of the machine's drift.
    paired_one = [a / b for a, b in zip(runs["make_parallel, 1 device"], runs["bare module"])]
    paired_two = [a / b for a, b in zip(runs["make_parallel, 2 CPU towers"], runs["bare module"])]
    one, two = statistics.median(paired_one), statistics.median(paired_two)
    print(f"  ratio wrapper/bare on one device: {one:.3f} (median of paired ratios; "
          f"{min(paired_one):.3f}-{max(paired_one):.3f})")
    print(f"  speedup of 2 CPU towers over the bare module: {two:.3f} ({min(paired_two):.3f}-{max(paired_two):.3f})")
    save_result("make_parallel_overhead", args, examples_per_sec=runs, median=med, ratio_one_device=one,
                paired_ratios_one_device=paired_one, paired_speedups_two_towers=paired_two,
                speedup_two_cpu_towers=two)


if __name__ == "__main__":
    main()
