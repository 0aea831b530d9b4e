"""phalanx ``sync`` against a plain hand-written DDP loop, side by side in one run.

Same model (the cifar10 tutorial network), same per-worker batch, same worker count and torch
threads per worker, same synthetic data. The variants are interleaved (DDP, phalanx, DDP, ...)
so that drift in the machine's load hits both alike; each repeat is a fresh job whose first
steps are a warm-up excluded from the timing. Prints medians with their spread, the ratio
phalanx / DDP, and weak-scaling efficiency (2 workers over 2 x 1 worker). Saves a JSON result
with the machine and versions under benchmarks/results/.

    python3 benchmarks/sync_vs_ddp.py                 # defaults: 5 repeats, 128 per worker
    python3 benchmarks/sync_vs_ddp.py --repeats 3 --steps 10 --warmup 3   # quicker
    python3 benchmarks/sync_vs_ddp.py --repeats 12 --two-only   # the 2-worker pair only, more repeats

``--two-only`` leaves out the one-worker runs (no efficiency figure), so that the same time buys more paired
repeats; the order of the pair alternates from repeat to repeat (DDP first, then phalanx first), and the paired
ratio's median comes with a 95% bootstrap interval.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from phalanx import TrainConfig, Trainer
from phalanx.data import load_synthetic
from phalanx.launcher import launch
from phalanx.task.models import build_model

from _common import bootstrap_median, parser, print_medians, save_result

SHAPE = (3, 24, 24)


def plain_ddp_worker(ctx, batch: int, warmup: int, steps: int, threads: int) -> float:
    """The loop a user would write by hand: DDP, SGD, a random batch of the same data each step."""
    torch.set_num_threads(threads)
    data = load_synthetic(SHAPE, size=4096, seed=0).train
    torch.manual_seed(0)
    model = build_model("cifar10", SHAPE, 10)
    if ctx.distributed:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(ctx.rank)
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        idx = torch.randint(0, len(data), (batch,), generator=gen)
        loss = F.cross_entropy(model(data.x[idx]), data.y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return batch * ctx.world_size * steps / (time.perf_counter() - start)


def plain_ddp(workers: int, batch: int, warmup: int, steps: int, threads: int) -> float:
    return launch(plain_ddp_worker, [torch.device("cpu")] * workers, (batch, warmup, steps, threads),
                  threads=threads)


def phalanx_sync(workers: int, batch: int, warmup: int, steps: int, threads: int) -> float:
    """phalanx's own loop; throughput from its metrics file, the warm-up interval left out."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(strategy="sync", workers=workers, devices="cpu", threads=threads, model="cifar10",
                          data="synthetic", synthetic_shape=SHAPE, batch_size=batch, steps=warmup + steps,
                          log_every=warmup, lr=0.01, progress="none", checkpoint_dir=tmp,
                          checkpoint_every=0)
        Trainer(cfg).fit()
        events = [json.loads(line) for line in Path(cfg.metrics).read_text().splitlines()]
    logged = [e for e in events if e["event"] == "step"]  # every --warmup steps, and at the last step
    # The first interval is the warm-up; each later one lasted (its step - the previous one's) steps,
    # the last one shorter where --steps is not a multiple of --warmup.
    seconds = sum(e["sec_per_batch"] * (e["step"] - before["step"]) for before, e in zip(logged, logged[1:]))
    return batch * workers * steps / seconds


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=128, help="images per worker per step")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=16, help="timed steps per repeat")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--two-only", action="store_true", help="only the 2-worker pair (no efficiency figure)")
    args = p.parse_args()

    variants = {
        "ddp x2": lambda: plain_ddp(2, args.batch, args.warmup, args.steps, args.threads),
        "phalanx x2": lambda: phalanx_sync(2, args.batch, args.warmup, args.steps, args.threads),
        "ddp x1": lambda: plain_ddp(1, args.batch, args.warmup, args.steps, args.threads),
        "phalanx x1": lambda: phalanx_sync(1, args.batch, args.warmup, args.steps, args.threads),
    }
    if args.two_only:
        variants = {name: run for name, run in variants.items() if name.endswith("x2")}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, run in variants.items() if r % 2 == 0 else reversed(variants.items()):
            runs[name].append(run())
            print(f"repeat {r + 1}/{args.repeats}  {name:<11} {runs[name][-1]:8.1f} examples/sec", flush=True)

    print(f"\ncifar10 network, {args.batch} images per worker, {args.threads} thread(s) per worker, "
          f"{args.steps} timed steps, {args.repeats} repeats (median, min-max)")
    med = print_medians(runs, 11, " examples/sec")
    ratio = med["phalanx x2"] / med["ddp x2"]
    paired = [p / d for p, d in zip(runs["phalanx x2"], runs["ddp x2"])]
    interval = bootstrap_median(paired)
    print(f"  ratio phalanx/DDP (2 workers): {ratio:.3f} (goal >= 1.00); paired per repeat: "
          f"{statistics.median(paired):.3f} (goal >= 0.98), 95% bootstrap {interval[0]:.3f}-{interval[1]:.3f}, "
          f"repeats {min(paired):.3f}-{max(paired):.3f}")
    goals = {"median ratio >= 1.00": ratio >= 1.0, "paired median >= 0.98": statistics.median(paired) >= 0.98}
    efficiency = {}
    if not args.two_only:
        efficiency = {"phalanx": med["phalanx x2"] / (2 * med["phalanx x1"]),
                      "ddp": med["ddp x2"] / (2 * med["ddp x1"])}
        goals["efficiency within 0.01 of DDP's"] = efficiency["phalanx"] >= efficiency["ddp"] - 0.01
        print(f"  weak-scaling efficiency (2 workers / 2 x 1 worker): phalanx {efficiency['phalanx']:.3f}, "
              f"DDP {efficiency['ddp']:.3f} (goal: within 0.01)")
    print("  goals: " + "; ".join(f"{name} {'met' if ok else 'NOT met'}" for name, ok in goals.items()))
    print(f"  load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")

    save_result("sync_vs_ddp", args, examples_per_sec=runs, median=med, ratio_phalanx_over_ddp=ratio,
                paired_ratios=paired, bootstrap_95_paired=interval, weak_scaling_efficiency=efficiency,
                goals_met=goals)


if __name__ == "__main__":
    main()
