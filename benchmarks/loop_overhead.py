"""phalanx's training loop against the loop a user writes by hand, one process, side by side in one run.

What it measures is the loop's own bookkeeping per step (the batch read, the strategy's step, the schedule,
the stop checks, the loss window): with one worker and no process group every strategy's communication is
skipped, so anything phalanx adds over a plain loop shows here. The model is small on purpose (the built-in
mlp on the digits, batch 32, one thread), where a step takes well under a millisecond and bookkeeping is the
largest share it will ever be.

Both loops train the same model from the same seed on the same in-memory tensors with the optimizer phalanx
resolves for it (the mlp's recipe: SGD, lr 0.05, momentum 0.9, read from ``TrainConfig.resolved()`` so the two
cannot drift apart). Until this round the hand-written loop ran SGD without momentum: half the optimizer's work,
some 57 us a step here (the two optimizers' steps timed alone), counted against phalanx. The hand-written loop
draws each epoch's order with ``torch.randperm`` and slices it, as a user would.
The variants alternate (hand, phalanx, hand, ...) so drift in the machine's load hits both alike; in each run
the first ``--warmup`` steps are left out of the timing (phalanx: its metrics file's step intervals).

    python3 benchmarks/loop_overhead.py                        # 5 rounds of 3,000 steps
    python3 benchmarks/loop_overhead.py --rounds 3 --steps 1000 --save
    python3 benchmarks/loop_overhead.py --clip-grad-norm 1.0 --save   # both loops clip every step
    python3 benchmarks/loop_overhead.py --in-worker --rounds 15        # + the hand-written loop in a worker process

With ``--clip-grad-norm`` the hand-written loop calls ``torch.nn.utils.clip_grad_norm_`` before each step and
phalanx runs with ``--clip-grad-norm``: the ratio then says what phalanx's clipping (the norm kept on the
device, read at log steps only) costs beyond torch's own call.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from phalanx import TrainConfig, Trainer
from phalanx.data import load_data
from phalanx.launcher import launch
from phalanx.task.models import build_model

from _common import bootstrap_median, parser, print_medians, save_result

#: the optimizer both loops run: the one phalanx resolves for the mlp (its recipe), so the loops do the same work
RECIPE = TrainConfig(model="mlp", data="digits").resolved()


def hand_written(steps: int, warmup: int, batch: int, clip: Optional[float] = None) -> float:
    """examples/s of the plain loop, the warm-up steps left out."""
    bundle = load_data("digits")
    data = bundle.train
    torch.manual_seed(0)
    model = build_model("mlp", bundle.input_shape, bundle.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=RECIPE.lr, momentum=RECIPE.momentum)
    order, at, start = torch.randperm(len(data.x)), 0, 0.0
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        if at + batch > len(order):
            order, at = torch.randperm(len(data.x)), 0
        idx = order[at:at + batch]
        at += batch
        loss = F.cross_entropy(model(data.x[idx]), data.y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return batch * steps / (time.perf_counter() - start)


def _in_worker(ctx, steps: int, warmup: int, batch: int, clip: Optional[float]) -> float:
    return hand_written(steps, warmup, batch, clip)


def hand_in_worker(steps: int, warmup: int, batch: int, clip: Optional[float] = None) -> float:
    """The same hand-written loop, run where phalanx runs its own: in a worker process that ``launch`` forks (one
    thread), so that what the process costs (the fork server's child, the parent watching it) is told apart from
    what the loop costs."""
    return launch(_in_worker, [torch.device("cpu")], (steps, warmup, batch, clip), threads=1)


def phalanx_loop(steps: int, warmup: int, batch: int, clip: Optional[float] = None) -> float:
    """examples/s of ``Trainer`` with one worker, from its metrics file's step intervals after the warm-up."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(model="mlp", data="digits", workers=1, devices="cpu", threads=1, batch_size=batch,
                          lr=RECIPE.lr, steps=warmup + steps, log_every=warmup, progress="none", checkpoint_dir=tmp,
                          checkpoint_every=0, clip_grad_norm=clip)
        Trainer(cfg).fit()
        events = [json.loads(line) for line in Path(cfg.metrics).read_text().splitlines()]
    logged = [e for e in events if e["event"] == "step"]
    seconds = sum(e["sec_per_batch"] * (e["step"] - before["step"]) for before, e in zip(logged, logged[1:]))
    return batch * (logged[-1]["step"] - logged[0]["step"]) / seconds


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3000, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--in-worker", action="store_true",
                   help="also run the hand-written loop in a phalanx worker process (what the process costs)")
    p.add_argument("--clip-grad-norm", type=float, default=None, help="both loops clip the gradient norm to this")
    args = p.parse_args()
    torch.set_num_threads(1)

    variants = {"hand-written": hand_written, "phalanx": phalanx_loop}
    if args.in_worker:
        variants["hand (worker)"] = hand_in_worker
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, run in variants.items():
            runs[name].append(run(args.steps, args.warmup, args.batch, args.clip_grad_norm))
            print(f"round {r + 1}/{args.rounds}  {name:<12} {runs[name][-1]:9.1f} examples/sec", flush=True)

    clipping = f", both clipping to {args.clip_grad_norm:g}" if args.clip_grad_norm is not None else ""
    print(f"\nmlp on digits, batch {args.batch}, 1 thread, {args.steps} timed steps, {args.rounds} rounds{clipping} "
          "(median, min-max)")
    med = print_medians(runs, 12, " examples/sec")
    ratio = med["phalanx"] / med["hand-written"]
    paired = [p / h for p, h in zip(runs["phalanx"], runs["hand-written"])]
    interval = bootstrap_median(paired)
    per_step_us = (args.batch / med["phalanx"] - args.batch / med["hand-written"]) * 1e6
    print(f"  ratio phalanx/hand-written: {ratio:.3f} (paired per round {statistics.median(paired):.3f}, "
          f"95% bootstrap {interval[0]:.3f}-{interval[1]:.3f}, rounds {min(paired):.3f}-{max(paired):.3f}); "
          f"phalanx adds {per_step_us:.0f} us a step (goal: ratio >= 0.97)")
    extra = {}
    if args.in_worker:  # the loop's own cost, the process's told apart
        in_worker = [p / h for p, h in zip(runs["phalanx"], runs["hand (worker)"])]
        process = [w / h for w, h in zip(runs["hand (worker)"], runs["hand-written"])]
        extra = {"paired_ratios_over_hand_in_worker": in_worker, "paired_ratios_hand_worker_over_hand": process,
                 "bootstrap_95_over_hand_in_worker": bootstrap_median(in_worker)}
        lo_, hi_ = extra["bootstrap_95_over_hand_in_worker"]
        print(f"  ratio phalanx/hand-written in a worker: paired {statistics.median(in_worker):.3f} "
              f"(95% bootstrap {lo_:.3f}-{hi_:.3f}); the worker process alone: hand in a worker/hand "
              f"{statistics.median(process):.3f}")
    print(f"  load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    save_result("loop_overhead" + ("-clip" if args.clip_grad_norm is not None else ""), args, examples_per_sec=runs,
                median=med, ratio_phalanx_over_hand=ratio, paired_ratios=paired, bootstrap_95_paired=interval,
                added_us_per_step=per_step_us, **extra)


if __name__ == "__main__":
    main()
