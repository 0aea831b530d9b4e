"""examples/gpt.py's quality under phalanx against the same model's plain PyTorch loop.

The plain loop is the one a nanoGPT user writes: the same model (``gpt.make``), data (``gpt.load``), steps,
global batch, optimizer (``model.configure_optimizers`` through ``gpt.optimizer``), schedule (``gpt.schedule``:
warmup, then cosine to a tenth) and clipping (1.0); each epoch's order drawn by ``torch.randperm`` and sliced.
Each figure is the test set's perplexity (exp of the mean cross-entropy per byte over every test window).

phalanx trains the same module through the installed CLI, 2 workers splitting the same global batch, with
nothing of the user's but the example's import paths (``FLAGS``). Seed s is the same initial model in every run
(phalanx seeds before it calls ``make``, as the plain loop does); the batches differ (each draws its own order),
so the plain loop's spread over seeds is the noise any comparison sits in. Runs alternate (plain, then each
strategy, seed by seed), so the machine's load drifts over all alike; the ratio is each strategy's median
perplexity over the plain loop's median.

    python3 benchmarks/gpt_quality.py                           # 400 steps of 64 windows, seed 0
    python3 benchmarks/gpt_quality.py --seeds 2 --save          # what the example's docstring quotes
    python3 benchmarks/gpt_quality.py --plain-only              # the reference loop alone, against the baselines
    python3 benchmarks/gpt_quality.py --plain-only --stale --seeds 2 --save   # and as asynchrony would run it
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import subprocess
import sys
import tempfile
from typing import Optional
from pathlib import Path

import torch
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import char_lm  # noqa: E402  (the baselines)
import gpt  # noqa: E402

from _common import parser, save_result  # noqa: E402

CLIP = 1.0
#: the user's whole glue on the command line: the example's import paths and the clipping
FLAGS = ["--model", "gpt:make", "--data", "gpt:load", "--training-step", "gpt:step", "--optimizer", "gpt:optimizer",
         "--lr-scheduler", "gpt:schedule", "--clip-grad-norm", str(CLIP)]
#: each strategy's own flags: local steps between averages as the example's default
STRATEGIES = {"sync": [], "fsdp": [], "local-sgd": ["--sync-every", "8"], "diloco": ["--sync-every", "8"], "ps": []}


def vocabulary(train: tuple, test: tuple) -> int:
    """The symbols the targets use: what phalanx offers ``make`` as ``num_classes``."""
    return int(max(train[1].max(), test[1].max())) + 1


def plain_loop(steps: int, batch_size: int, seed: int = 0) -> gpt.GPT:
    """nanoGPT's loop, shrunk: forward with targets, backward, clip, AdamW step, schedule step."""
    train, test = gpt.load()
    x, y = train
    torch.manual_seed(seed)
    model = gpt.make(vocabulary(train, test))
    opt = gpt.optimizer(model)
    sched = gpt.schedule(opt, steps)
    order, at = torch.randperm(len(x)), 0
    for _ in range(steps):
        if at + batch_size > len(order):  # a new epoch: a new order, the leftover windows dropped
            order, at = torch.randperm(len(x)), 0
        idx = order[at:at + batch_size]
        at += batch_size
        _, loss = model(x[idx], y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
    return model


def stale_loop(steps: int, batch_size: int, workers: int = 2, seed: int = 0) -> gpt.GPT:
    """The plain loop as an asynchronous parameter server runs it with ``workers`` workers that keep pace:
    ``workers`` updates a step, each on ``batch_size / workers`` windows, its gradient computed on the
    parameters of one update before (staleness 1, what ps measured with 2 workers) and scaled by 1/workers;
    the schedule stepped once a step. Plain PyTorch: what asynchrony alone costs this model."""
    train, test = gpt.load()
    x, y = train
    torch.manual_seed(seed)
    model = gpt.make(vocabulary(train, test))
    behind = copy.deepcopy(model)  # the parameters a worker computed its gradient on
    opt = gpt.optimizer(model)
    sched = gpt.schedule(opt, steps)
    per, order, at = batch_size // workers, torch.randperm(len(x)), 0
    for update in range(steps * workers):
        if at + per > len(order):
            order, at = torch.randperm(len(x)), 0
        idx = order[at:at + per]
        at += per
        _, loss = behind(x[idx], y[idx])
        behind.zero_grad(set_to_none=True)
        loss.backward()
        behind.load_state_dict(model.state_dict())  # the next gradient: on these parameters, one update old then
        for p, b in zip(model.parameters(), behind.parameters()):
            p.grad = b.grad / workers
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if update % workers == workers - 1:
            sched.step()
    return model


@torch.no_grad()
def perplexity(model: gpt.GPT, test: tuple, batch: int = 256) -> float:
    """exp of the mean cross-entropy over every test byte (the sum over batches, then one division)."""
    model.eval()
    total, count = 0.0, 0
    for at in range(0, len(test[0]), batch):
        xb, yb = test[0][at:at + batch], test[1][at:at + batch]
        logits, _ = model(xb, yb)
        total += float(F.cross_entropy(logits.flatten(0, 1), yb.flatten(), reduction="sum"))
        count += yb.numel()
    model.train()
    return math.exp(total / count)


def phalanx_run(strategy: str, steps: int, batch_size: int, workers: int, seed: int,
                sync_every: Optional[int] = None) -> float:
    """The test perplexity of ``phalanx train`` with ``strategy`` (its summary in the metrics file); ``sync_every``
    replaces the example's local steps between averages (local-sgd, diloco)."""
    own = STRATEGIES[strategy]
    if sync_every is not None and own:
        own = ["--sync-every", str(sync_every)]
    with tempfile.TemporaryDirectory() as folder:
        cmd = ["phalanx", "train", *FLAGS, "--strategy", strategy, *own, "--workers", str(workers),
               "--batch-size", str(batch_size // workers), "--steps", str(steps), "--seed", str(seed),
               "--checkpoint-dir", folder, "--checkpoint-every", "0", "--progress", "none"]
        done = subprocess.run(cmd, cwd=EXAMPLES, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        events = [json.loads(line) for line in Path(folder, "metrics.jsonl").read_text().splitlines()]
    return next(e for e in reversed(events) if e["event"] == "summary")["test_metrics"]["perplexity"]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=64, help="the global batch, in windows of 64 bytes")
    p.add_argument("--seeds", type=int, default=1, help="plain runs with seeds 0..N-1")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the plain loop")
    p.add_argument("--workers", type=int, default=2, help="phalanx's training processes (ps: and a server)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, of " + ", ".join(STRATEGIES))
    p.add_argument("--sync-every", type=int, default=None, help="local-sgd and diloco: local steps between "
                                                                 "averages (default: the example's 8)")
    p.add_argument("--plain-only", action="store_true", help="the reference loop alone")
    p.add_argument("--stale", action="store_true", help="also the plain loop with gradients one update stale, as "
                                                        "ps applies them (--workers updates a step)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    train, test = gpt.load()
    base = char_lm.baselines(train, test)
    print(f"baselines: uniform {base['uniform']:.1f}, unigram {base['unigram']:.2f}")
    names = [] if args.plain_only else args.strategies.split(",")
    runs: dict[str, list[float]] = {"plain": [], **{name: [] for name in names}}
    for seed in range(args.seeds):
        runs["plain"].append(perplexity(plain_loop(args.steps, args.batch_size, seed), test))
        print(f"seed {seed}: plain PyTorch {runs['plain'][-1]:.3f}", flush=True)
        if args.stale:
            runs.setdefault("plain-stale", []).append(perplexity(stale_loop(args.steps, args.batch_size,
                                                                            args.workers, seed), test))
            print(f"seed {seed}: plain PyTorch, gradients one update stale {runs['plain-stale'][-1]:.3f}", flush=True)
        for name in names:
            runs[name].append(phalanx_run(name, args.steps, args.batch_size, args.workers, seed, args.sync_every))
            print(f"seed {seed}: phalanx {name} {runs[name][-1]:.3f}", flush=True)
    medians = {name: statistics.median(v) for name, v in runs.items()}
    ratios = {name: medians[name] / medians["plain"] for name in runs}
    print(f"\ntest perplexity after {args.steps} steps of {args.batch_size} windows, median (min-max) over "
          f"{args.seeds} seed(s); ratio to the plain loop's median:")
    for name, values in runs.items():
        print(f"  {name:<11} {medians[name]:7.3f} ({min(values):.3f}-{max(values):.3f})  ratio {ratios[name]:.3f}")
    name = "gpt_quality-stale" if args.stale and args.plain_only else "gpt_quality"  # (the strategies' kept apart)
    if args.sync_every is not None:
        name += f"-h{args.sync_every}"
    save_result(name, args, baselines=base, perplexity=runs, medians=medians, ratios=ratios)


if __name__ == "__main__":
    main()
