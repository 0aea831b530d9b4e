"""Pipeline benchmarks, side by side in one run of two worker processes (2 stages).

1. Bubble: each stage is one block whose forward sleeps F ms and backward sleeps B ms per
   micro-batch (a calibrated sleep: no CPU contention, so the schedule alone sets the timing).
   Per step, each rank records the time it really spent in its block; the measured bubble is
   1 − busy / step time, averaged over the stages, against the textbook (P−1)/(M+P−1), for
   M = 1, 2, 4, 8 (GPipe; 1F1B for M ≥ P too). Goal: within ±5 percentage points.
2. Balance: an imbalanced model (9 light blocks, then one block 9 times heavier) trained with
   ``balance="time"`` (the exact partition of block times measured in the workers, as the
   stages run) against an equal split by block count (5, 5). Twice: blocks whose cost is a
   calibrated sleep (2 ms, and 18 ms for the heavy one), and a real MLP (9 one-layer blocks,
   then one of 9 layers, CPU compute on the shared cores): **the goal is judged on the MLP**:
   ≥ 1.3× the throughput of the equal split, and the speed-up the plan predicted (its predicted
   step for (5, 5) over its own, from the same measurements) within 10% of the measured one.
   For the MLP the same two plans also run on torch's own ``ScheduleGPipe`` (receives posted
   just in time) beside phalanx's (receives posted ahead, ``phalanx/strategies/pipeline/schedule.py``), so
   the run shows what the schedule costs a balanced pipeline.

Variants are interleaved within every repeat (the machine's load drift hits all alike), each
after warm-up steps; medians with their spread and the ratios are printed and saved with the
machine and versions under benchmarks/results/, with the load other processes put on the machine
while the balance parts were timed (a balanced pipeline has no idle core to absorb it: its
figures mean something only where that is about 0 cores).

    python3 benchmarks/pipeline.py                      # defaults: 5 repeats (about three minutes)
    python3 benchmarks/pipeline.py --parts mlp --repeats 9   # the goal alone (about a minute)
"""

from __future__ import annotations

import json
import os
import resource
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
from phalanx.launcher import launch
from phalanx.strategies.balance import ideal_bubble

from _common import parser, machine_info, result_path, spread

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


def _busy_cpu_seconds() -> float:
    """CPU-seconds every process on this machine has used (Linux: /proc/stat), else nan."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:8]]
    except OSError:
        return float("nan")
    user, nice, system, idle, iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


#: per timed window, the cores that processes other than the workers kept busy (a quiet machine: ~0)
OTHER_LOAD: list[float] = []


def _timed_steps(ctx, strategy, x, y, steps: int) -> float:
    """Seconds for ``steps`` training steps, started together, ended when the last rank is done.

    Also notes in OTHER_LOAD how many cores the rest of the machine kept busy meanwhile (the
    machine's busy CPU time less every worker's own): a balanced pipeline has no idle stage to
    absorb someone else's work, so its speed-up is only meaningful where that is about 0.
    """
    dist.barrier()
    busy, own = _busy_cpu_seconds(), _own_cpu_seconds()
    start = time.perf_counter()
    for _ in range(steps):
        strategy.global_losses(strategy.train_step(x, y))
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    mine = torch.tensor([_own_cpu_seconds() - own], dtype=torch.float64)
    dist.all_reduce(mine)
    OTHER_LOAD.append(max(0.0, _busy_cpu_seconds() - busy - mine.item()) / took.item())
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
    """``light`` blocks sleeping ``light_ms`` per micro-batch (a third forward, the rest backward), then one of
    ``heavy_ms``."""
    block = lambda ms: SleepBlock(ms / 3e3, 2 * ms / 3e3, width=16)  # noqa: E731
    return nn.Sequential(*[block(light_ms) for _ in range(light)], block(heavy_ms))


EQUAL, TIMED = "equal split by block count", "balanced by measured time"


def _torch_gpipe(pipe) -> None:
    """Make ``pipe`` step with torch's ScheduleGPipe (receives posted just in time) instead of phalanx's."""
    from torch.distributed.pipelining import ScheduleGPipe

    micro = pipe.options.chunks
    pipe._schedules[micro] = ScheduleGPipe(pipe._stage, micro, loss_fn=pipe.build.loss_fn, scale_grads=True)


def balance_worker(ctx, args, make_model, width: int, torch_too: bool = False) -> dict:
    """Throughput of an equal split by block count against the partition of measured block times."""
    batch = args.micro_batch * args.chunks
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    variants = {EQUAL: (5, 5), TIMED: "time"}
    pipes, plans = {}, {}
    for name, balance in variants.items():
        torch.manual_seed(0)
        pipe = runtime_for(Pipeline(chunks=args.chunks, balance=balance), ctx, make_model(), _optimizer, F.mse_loss,
                           example=(x, y))
        pipes[name], plans[name] = pipe, pipe.plan.lines()
        if torch_too:
            torch.manual_seed(0)
            same = runtime_for(Pipeline(chunks=args.chunks, balance=pipe.plan.counts), ctx, make_model(), _optimizer,
                               F.mse_loss)
            _torch_gpipe(same)
            pipes[f"{name}, torch's ScheduleGPipe"] = same
    plan = pipes[TIMED].plan  # one set of measurements prices both partitions
    predicted = {"step_ms": {EQUAL: plan.step_seconds(variants[EQUAL]) * 1e3, TIMED: plan.step_seconds() * 1e3},
                 "speedup": plan.speedup_over(variants[EQUAL]), "counts": list(plan.counts)}
    samples: dict = {name: [] for name in pipes}
    loads = []
    for repeat in range(args.repeats + 1):  # repeat 0 is the warm-up
        for name in pipes:
            took = _timed_steps(ctx, pipes[name], x, y, args.steps)
            if repeat:
                samples[name].append(batch * args.steps / took)
                loads.append(OTHER_LOAD[-1])
    return {"throughput": samples, "plans": plans, "predicted": predicted, "batch": batch, "other_load": loads}


PARTS = ("bubble", "sleep", "mlp")


def worker(ctx, args, path: str) -> None:
    torch.set_num_threads(1)
    sleeping = partial(imbalanced_sleep, args.light_ms, args.heavy_ms)
    parts = {"bubble": lambda: bubble_worker(ctx, args),
             "balance sleep": lambda: balance_worker(ctx, args, sleeping, 16),
             "balance mlp": lambda: balance_worker(ctx, args, partial(imbalanced_mlp, args.width), args.width,
                                                   torch_too=True)}
    out = {key: run() for key, run in parts.items() if key.split()[-1] in args.parts}
    if ctx.rank == 0:
        Path(path).write_text(json.dumps(out))


def summarise(values: list[float]) -> dict:
    lo, hi = spread(values)
    return {"median": statistics.median(values), "min": lo, "max": hi, "samples": values}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant and repeat")
    p.add_argument("--forward-ms", type=float, default=40.0, help="sleep per micro-batch and stage, forward")
    p.add_argument("--backward-ms", type=float, default=80.0, help="sleep per micro-batch and stage, backward")
    p.add_argument("--light-ms", type=float, default=2.0, help="balance, sleep model: a light block's cost")
    p.add_argument("--heavy-ms", type=float, default=18.0, help="balance, sleep model: the heavy block's cost")
    p.add_argument("--width", type=int, default=256, help="balance, real compute: MLP width")
    p.add_argument("--micro-batch", type=int, default=256)
    p.add_argument("--chunks", type=int, default=16, help="balance part: micro-batches per step")
    p.add_argument("--parts", default=",".join(PARTS),
                   help="which parts to run, comma-separated: bubble, sleep (balance, sleep model), mlp (balance, "
                        "real compute: the goal)")
    args = p.parse_args()
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        p.error(f"unknown --parts {', '.join(unknown)}: choose from {', '.join(PARTS)}")

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "out.json")
        started = time.perf_counter()
        launch(worker, [torch.device("cpu")] * STAGES, (args, path), threads=1)
        raw = json.loads(Path(path).read_text())
    result = {"benchmark": "pipeline", "machine": machine_info(), "settings": vars(args), "stages": STAGES,
              "seconds": round(time.perf_counter() - started, 1), "bubble": {}}

    if "bubble" in raw:
        print(f"bubble, {STAGES} stages, sleep {args.forward_ms:g} ms forward + {args.backward_ms:g} ms backward per "
              f"micro-batch and stage ({args.repeats} repeats x {args.steps} steps):")
    for name, values in raw.get("bubble", {}).items():
        m = int(name.split("M=")[1])
        expected = ideal_bubble(STAGES, m)
        s = summarise(values)
        s.update(expected=expected, off_points=100 * (s["median"] - expected),
                 within_5_points=abs(s["median"] - expected) <= 0.05)
        result["bubble"][name] = s
        print(f"  {name:10s} measured {s['median']:6.1%} (spread {s['min']:.1%}..{s['max']:.1%}), "
              f"(P-1)/(M+P-1) = {expected:6.1%}, off by {s['off_points']:+.1f} points")

    titles = {
        "balance sleep": f"balance, calibrated sleep: 9 blocks of {args.light_ms:g} ms + 1 block of "
                         f"{args.heavy_ms:g} ms "
                         f"per micro-batch (fwd+bwd), {args.chunks} micro-batches",
        "balance mlp": f"balance, real compute: MLP of 9 one-layer blocks + 1 block of 9 layers, width {args.width}, "
                       f"{args.chunks} micro-batches of {args.micro_batch}, 1 thread per stage (the goal)",
    }
    for key, title in titles.items():
        if key not in raw:
            continue
        print(title + ":")
        result[key] = report_balance(raw[key], goal=key == "balance mlp")
    save(result, args.save)


def report_balance(raw: dict, goal: bool) -> dict:
    """Medians per variant, the measured speed-up (paired per repeat) against the predicted one, and the goal."""
    out = {}
    tp, batch = raw["throughput"], raw["batch"]
    for name, values in tp.items():
        s = summarise(values)
        out[name] = {**s, "step_ms": batch / s["median"] * 1e3, "plan": raw["plans"].get(name)}
        print(f"  {name:50s} {s['median']:9.1f} examples/sec (spread {s['min']:.1f}..{s['max']:.1f}), "
              f"step {out[name]['step_ms']:.1f} ms")
        for line in raw["plans"].get(name, []):
            print(f"      {line}")
    predicted = raw["predicted"]
    out["predicted"] = predicted
    out["other_load"] = summarise(raw["other_load"])
    print(f"  other load on the machine while timing: median {out['other_load']['median']:.2f} cores "
          f"(max {out['other_load']['max']:.2f}; the figures below need about 0)")
    print(f"  predicted step (from the balanced plan's measurements): equal split "
          f"{predicted['step_ms'][EQUAL]:.1f} ms, balanced {predicted['step_ms'][TIMED]:.1f} ms")
    for suffix in ("", ", torch's ScheduleGPipe"):
        if EQUAL + suffix not in tp:
            continue
        ratios = [b / a for a, b in zip(tp[EQUAL + suffix], tp[TIMED + suffix])]
        speedup = statistics.median(ratios)
        off = predicted["speedup"] / speedup - 1
        key = "speedup" + suffix.replace(", torch's ScheduleGPipe", " torch gpipe")
        out[key] = {**summarise(ratios), "predicted": predicted["speedup"], "prediction_off": off,
                    "goal_1.3x_met": speedup >= 1.3, "prediction_within_10%": abs(off) <= 0.10}
        label = "phalanx gpipe (receives ahead)" if not suffix else "torch ScheduleGPipe (just in time)"
        judged = goal and not suffix
        print(f"  speed-up of time balancing, {label}: measured {speedup:.2f}x (per repeat {min(ratios):.2f}.."
              f"{max(ratios):.2f}), predicted {predicted['speedup']:.2f}x ({off:+.1%})"
              + (f"; goal >= 1.3x {'met' if speedup >= 1.3 else 'NOT met'}, prediction within 10% "
                 f"{'met' if abs(off) <= 0.10 else 'NOT met'}" if judged else ""))
    return out


def save(result: dict, to_results: bool) -> None:
    out = result_path("pipeline", to_results)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
