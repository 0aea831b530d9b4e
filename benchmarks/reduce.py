"""All-reduce of gradient-sized buffers: torch's plain all_reduce, phalanx hierarchical, bf16.

Side by side in one job per worker count (2 and 4 gloo workers on loopback), sizes 1, 10 and
100 MB of float32; the variants are interleaved within every repeat. Prints the median time, the
bus bandwidth 2(N-1)/N * bytes / time (the figure NCCL's tests report) and the ratio of each
variant's time to plain, with the goal beside it. Islands for hierarchical: pairs of consecutive
ranks (with 2 workers a single island: the hierarchy has nothing to do and must cost nothing).

The bf16 variants: "bf16, fresh cast" is what torch's bf16_compress_hook does (a new half-precision
tensor per bucket per step); "phalanx bf16" is phalanx's hook (the buffer kept between steps);
"bf16 all_reduce only" times the collective on an already-cast buffer (what the wire saves).

    python3 benchmarks/reduce.py [--repeats 7 --sizes 1,10,100 --workers 2,4]
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from phalanx.launcher import launch
from phalanx.comm.reduce import HierarchicalState, WireBuffers, degenerate

from _common import parser, save_result


def islands_for(n: int) -> list[list[int]]:
    return [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]


def worker(ctx, sizes_mb: list[int], repeats: int) -> dict:
    n = ctx.world_size
    hier = HierarchicalState.build(islands_for(n), ctx.rank, n)
    wire = WireBuffers(torch.bfloat16)

    def phalanx_bf16(t):
        half = wire.cast(t).div_(n)
        dist.all_reduce(half)
        t.copy_(half)

    variants = {
        "plain all_reduce": lambda t: dist.all_reduce(t),
        "phalanx hierarchical": lambda t: hier.reduce(t),
        "bf16, fresh cast": lambda t: t.copy_(_all_reduced(t.to(torch.bfloat16).div_(n))),
        "phalanx bf16": phalanx_bf16,
        "bf16 all_reduce only": lambda t: dist.all_reduce(cast[t.numel()]),
    }
    out: dict = {}
    for mb in sizes_mb:
        buf = torch.randn(mb * 2**20 // 4)
        cast = {buf.numel(): buf.to(torch.bfloat16)}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(repeats + 1):  # the first round is a warm-up
            for name, op in variants.items():
                dist.barrier()
                start = time.perf_counter()
                op(buf)
                elapsed = time.perf_counter() - start
                if r:
                    times[name].append(elapsed)
        # the slowest rank's time is the collective's time
        slowest = {}
        for name, ts in times.items():
            t = torch.tensor(ts, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            slowest[name] = t.tolist()
        out[mb] = slowest
    return out


def _all_reduced(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


def goal(name: str, n: int, mb: int) -> str:
    """What the variant must achieve against plain (issue 13), or '' where nothing is asked."""
    if name == "phalanx hierarchical" and degenerate(islands_for(n)):
        return "goal 1.00 (one island: flat)"
    if name == "phalanx bf16" and mb >= 16:
        return "goal <= 0.60"
    return ""


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--sizes", default="1,10,100", help="MB, comma-separated")
    p.add_argument("--workers", default="2,4", help="worker counts, comma-separated")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    report: dict = {}
    for n in (int(w) for w in args.workers.split(",")):
        times = launch(worker, [torch.device("cpu")] * n, (sizes, args.repeats), threads=1)
        report[n] = {}
        print(f"\n{n} gloo workers, islands {islands_for(n)} (median of {args.repeats}, min-max)")
        print(f"  {'size':>6}  {'variant':<22} {'time ms':>9} {'spread ms':>15} {'busbw GB/s':>10} "
              f"{'vs plain':>8}  goal")
        for mb, variants in times.items():
            plain = statistics.median(variants["plain all_reduce"])
            for name, ts in variants.items():
                med = statistics.median(ts)
                busbw = 2 * (n - 1) / n * mb * 2**20 / med / 1e9
                report[n].setdefault(mb, {})[name] = {"median_s": med, "times_s": ts, "busbw_gbps": busbw,
                                                      "ratio_to_plain": med / plain}
                print(f"  {mb:>4}MB  {name:<22} {med * 1e3:9.2f} {min(ts) * 1e3:7.2f}-{max(ts) * 1e3:<7.2f} "
                      f"{busbw:10.2f} {med / plain:8.2f}  {goal(name, n, mb)}")
    save_result("reduce", args, results=report)


if __name__ == "__main__":
    main()
