"""Pipeline benchmarks, side by side in one run of two worker processes (2 stages).

1. Bubble: each stage is one block whose forward sleeps F ms and backward sleeps B ms per
   micro-batch (a calibrated sleep: no CPU contention, so the schedule alone sets the timing).
   Per step, each rank records the time it really spent in its block; the measured bubble is
   1 − busy / step time, averaged over the stages, against the textbook (P−1)/(M+P−1), for
   M = 1, 2, 4, 8 (GPipe; 1F1B for M ≥ P too). Goal: within ±5 percentage points.
2. Balance: an imbalanced model (9 light blocks, then one block 9 times heavier) trained with
   ``balance="time"`` (the exact partition of measured block times) against an equal split by
   block count (5, 5). Goal: ≥ 1.3× the throughput. Twice: blocks whose cost is a calibrated
   sleep (2 ms, and 18 ms for the heavy one: the goal is judged on this, since only the plan
   differs), and a real MLP (9 one-layer blocks, then one of 9 layers) whose CPU time depends
   on what else the shared cores run.

Variants are interleaved within every repeat (the machine's load drift hits all alike), each
after warm-up steps; medians with their spread and the ratios are printed and saved with the
machine and versions under benchmarks/results/.

    python3 benchmarks/pipeline.py                      # defaults: 5 repeats (about two minutes)
    python3 benchmarks/pipeline.py --repeats 3 --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from phalanx import Pipeline
from phalanx.strategies import runtime_for
from phalanx.launch import launch
from phalanx.pipeline.balance import ideal_bubble

from _common import machine_info, result_path, spread

STAGES = 2
MICRO = (1, 2, 4, 8)


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take a set time, and count the time really slept."""

    @staticmethod
    def forward(ctx, x, block):
        ctx.block = block
        block.sleep(block.forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.block.sleep(ctx.block.backward_s)
        return grad, None


class SleepBlock(nn.Module):
    def __init__(self, forward_s: float, backward_s: float, width: int = 16):
        super().__init__()
        self.linear = nn.Linear(width, width)  # something to train, so the backward runs
        self.forward_s, self.backward_s, self.busy = forward_s, backward_s, 0.0

    def sleep(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.busy += time.perf_counter() - start

    def forward(self, x):
        return _Sleep.apply(self.linear(x), self)


def imbalanced_mlp(width: int, light: int = 9, heavy: int = 9) -> nn.Sequential:
    """``light`` one-layer blocks, then one block of ``heavy`` layers: the plan profiles, never assumes, the costs."""
    layer = lambda: nn.Sequential(nn.Linear(width, width), nn.Tanh())  # noqa: E731
    blocks = [layer() for _ in range(light)] + [nn.Sequential(*[layer() for _ in range(heavy)])]
    return nn.Sequential(*blocks)


def _optimizer(params):
    return torch.optim.SGD(params, lr=1e-3)


def _timed_steps(ctx, strategy, x, y, steps: int) -> float:
    """Seconds for ``steps`` training steps, started together, ended when the last rank is done."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        strategy.global_losses(strategy.train_step(x, y))
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def bubble_worker(ctx, args) -> dict:
    variants = [("gpipe", m) for m in MICRO] + [("1f1b", m) for m in MICRO if m >= STAGES]
    pipes = {}
    for schedule, m in variants:
        torch.manual_seed(0)
        model = nn.Sequential(*[SleepBlock(args.forward_ms / 1e3, args.backward_ms / 1e3) for _ in range(STAGES)])
        pipe = runtime_for(Pipeline(chunks=m, schedule=schedule, balance=(1,) * STAGES), ctx, model, _optimizer,
                           F.mse_loss)
        pipes[(schedule, m)] = pipe
    x, y = torch.randn(8 * max(MICRO), 16), torch.randn(8 * max(MICRO), 16)
    samples: dict = {v: [] for v in variants}
    for repeat in range(args.repeats + 1):  # repeat 0 is the warm-up
        for v in variants:
            block = pipes[v].model.blocks[0]
            block.busy = 0.0
            took = _timed_steps(ctx, pipes[v], x, y, args.steps)
            busy = torch.tensor([block.busy], dtype=torch.float64)
            dist.all_reduce(busy)
            if repeat:
                samples[v].append(1.0 - busy.item() / ctx.world_size / took)
    return {f"{s} M={m}": samples[(s, m)] for s, m in variants}


def imbalanced_sleep(light_ms: float, heavy_ms: float, light: int = 9) -> nn.Sequential:
    """``light`` blocks sleeping ``light_ms`` per micro-batch (a third forward, the rest backward), then one of ``heavy_ms``."""
    block = lambda ms: SleepBlock(ms / 3e3, 2 * ms / 3e3, width=16)  # noqa: E731
    return nn.Sequential(*[block(light_ms) for _ in range(light)], block(heavy_ms))


def balance_worker(ctx, args, make_model, width: int) -> dict:
    """Throughput of an equal split by block count against the partition of measured block times."""
    batch = args.micro_batch * args.chunks
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    variants = {"equal split by block count": (5, 5), "balanced by measured time": "time"}
    pipes, plans = {}, {}
    for name, balance in variants.items():
        torch.manual_seed(0)
        pipe = runtime_for(Pipeline(chunks=args.chunks, balance=balance), ctx, make_model(), _optimizer, F.mse_loss,
                           example=(x, y))
        pipes[name], plans[name] = pipe, pipe.plan.lines()
    samples: dict = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):
        for name in variants:
            took = _timed_steps(ctx, pipes[name], x, y, args.steps)
            if repeat:
                samples[name].append(batch * args.steps / took)
    return {"throughput": samples, "plans": plans}


def worker(ctx, args, path: str) -> None:
    torch.set_num_threads(1)
    sleeping = partial(imbalanced_sleep, args.light_ms, args.heavy_ms)
    out = {"bubble": bubble_worker(ctx, args),
           "balance sleep": balance_worker(ctx, args, sleeping, 16),
           "balance mlp": balance_worker(ctx, args, partial(imbalanced_mlp, args.width), args.width)}
    if ctx.rank == 0:
        Path(path).write_text(json.dumps(out))


def summarise(values: list[float]) -> dict:
    lo, hi = spread(values)
    return {"median": statistics.median(values), "min": lo, "max": hi, "samples": values}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant and repeat")
    p.add_argument("--forward-ms", type=float, default=40.0, help="sleep per micro-batch and stage, forward")
    p.add_argument("--backward-ms", type=float, default=80.0, help="sleep per micro-batch and stage, backward")
    p.add_argument("--light-ms", type=float, default=2.0, help="balance, sleep model: a light block's cost")
    p.add_argument("--heavy-ms", type=float, default=18.0, help="balance, sleep model: the heavy block's cost")
    p.add_argument("--width", type=int, default=256, help="balance, real compute: MLP width")
    p.add_argument("--micro-batch", type=int, default=256)
    p.add_argument("--chunks", type=int, default=16, help="balance part: micro-batches per step")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "out.json")
        started = time.perf_counter()
        launch(worker, [torch.device("cpu")] * STAGES, (args, path), threads=1)
        raw = json.loads(Path(path).read_text())
    result = {"benchmark": "pipeline", "machine": machine_info(), "settings": vars(args), "stages": STAGES,
              "seconds": round(time.perf_counter() - started, 1), "bubble": {}}

    print(f"bubble, {STAGES} stages, sleep {args.forward_ms:g} ms forward + {args.backward_ms:g} ms backward per "
          f"micro-batch and stage ({args.repeats} repeats x {args.steps} steps):")
    for name, values in raw["bubble"].items():
        m = int(name.split("M=")[1])
        expected = ideal_bubble(STAGES, m)
        s = summarise(values)
        s.update(expected=expected, off_points=100 * (s["median"] - expected), within_5_points=abs(s["median"] - expected) <= 0.05)
        result["bubble"][name] = s
        print(f"  {name:10s} measured {s['median']:6.1%} (spread {s['min']:.1%}..{s['max']:.1%}), "
              f"(P-1)/(M+P-1) = {expected:6.1%}, off by {s['off_points']:+.1f} points")

    titles = {
        "balance sleep": f"balance, calibrated sleep: 9 blocks of {args.light_ms:g} ms + 1 block of {args.heavy_ms:g} ms "
                         f"per micro-batch (fwd+bwd), {args.chunks} micro-batches (the goal)",
        "balance mlp": f"balance, real compute: MLP of 9 one-layer blocks + 1 block of 9 layers, width {args.width}, "
                       f"{args.chunks} micro-batches of {args.micro_batch} (CPU compute, shared cores)",
    }
    for key, title in titles.items():
        print(title + ":")
        result[key] = report_balance(raw[key])
    save(result)


def report_balance(raw: dict) -> dict:
    out = {}
    tp = raw["throughput"]
    for name, values in tp.items():
        s = summarise(values)
        out[name] = {**s, "plan": raw["plans"][name]}
        print(f"  {name:27s} {s['median']:9.1f} examples/sec (spread {s['min']:.1f}..{s['max']:.1f})")
        for line in raw["plans"][name]:
            print(f"      {line}")
    ratios = [b / a for a, b in zip(tp["equal split by block count"], tp["balanced by measured time"])]
    out["speedup"] = summarise(ratios)
    print(f"  speedup of time balancing: {statistics.median(ratios):.2f}x "
          f"(per repeat {min(ratios):.2f}..{max(ratios):.2f}; goal >= 1.3x)")
    return out


def save(result: dict) -> None:
    out = result_path("pipeline")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
