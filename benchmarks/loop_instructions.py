"""phalanx's 1-worker loop against the hand-written loop, in instructions a step (valgrind's callgrind).

On the shared 2-core machine a wall-clock ratio of the two loops swings by ±20% from round to round
(``loop_overhead.py``'s bootstrap interval says so), ten times the gap it is meant to measure. An instruction
count does not move with the load. Each loop runs in this process under callgrind, instrumentation off until
step ``--from`` and on for ``--steps`` steps (``callgrind_control -i``); both loops switch it the same way, so
what the switching costs cancels in the difference. The loops are ``loop_overhead.py``'s: the digits mlp, batch
32, one thread, the mlp's recipe (SGD, momentum 0.9); phalanx's is ``run_worker`` called in this process (no
worker process: what a process costs is ``loop_overhead.py --in-worker``'s to say), logging every 100 steps, so
the counted steps hold one look at the loss window and one log line.

    python3 benchmarks/loop_instructions.py --save      # both loops under callgrind (minutes: valgrind is slow)
    python3 benchmarks/loop_instructions.py --files hand=cg.hand phalanx=cg.phalanx --save   # read earlier runs

The per-C-function difference (``callgrind_annotate``) is printed too: where the extra instructions go.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import parser, save_result

HERE = Path(__file__).resolve().parent


def child(which: str, first: int, steps: int) -> None:
    """One loop, switching callgrind's instrumentation on at step ``first`` and off at ``first + steps``."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)

    def toggle(step: int) -> None:
        if step in (first, first + steps):
            subprocess.run(["callgrind_control", "-i", "on" if step == first else "off", str(os.getpid())],
                           check=True, stdout=subprocess.DEVNULL)

    sys.path.insert(0, str(HERE))
    from loop_overhead import RECIPE

    if which == "phalanx":
        from phalanx import TrainConfig, Trainer
        from phalanx.launcher.context import WorkerContext
        from phalanx.train import loop

        with tempfile.TemporaryDirectory() as tmp:
            cfg = TrainConfig(model="mlp", data="digits", workers=1, devices="cpu", threads=1, batch_size=32,
                              lr=RECIPE.lr, steps=first + steps + 10, log_every=100, progress="none",
                              checkpoint_dir=tmp, checkpoint_every=0)
            plan = Trainer(cfg).plan()
            inner = loop.WorkerRun._step

            def step(self, inputs):
                toggle(self.step)
                return inner(self, inputs)

            loop.WorkerRun._step = step
            loop.run_worker(WorkerContext(0, 1, 0, torch.device("cpu"), None), plan)
        return
    from phalanx.data import load_data
    from phalanx.task.models import build_model

    bundle, batch = load_data("digits"), 32
    data = bundle.train
    torch.manual_seed(0)
    model = build_model("mlp", bundle.input_shape, bundle.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=RECIPE.lr, momentum=RECIPE.momentum)
    order, at = torch.randperm(len(data.x)), 0
    for step in range(first + steps + 10):  # loop_overhead.hand_written's loop, with the switch
        toggle(step)
        if at + batch > len(order):
            order, at = torch.randperm(len(data.x)), 0
        idx = order[at:at + batch]
        at += batch
        loss = F.cross_entropy(model(data.x[idx]), data.y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def run_under_callgrind(which: str, first: int, steps: int, out: Path) -> Path:
    subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                    sys.executable, __file__, "--child", which, "--from", str(first), "--steps", str(steps)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def by_function(path: Path) -> dict[str, int]:
    """Instructions per C function (exclusive), as ``callgrind_annotate`` lists them."""
    text = subprocess.run(["callgrind_annotate", "--threshold=100", str(path)], check=True, capture_output=True,
                          text=True).stdout
    counts: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)", line)
        if m and "PROGRAM TOTALS" not in m.group(2):
            name = re.sub(r"\s*\[.*\]$", "", m.group(2)).replace("???:", "").strip()
            name = re.sub(r"^/tmp/python-build[^/]*/[^/]*/", "cpython:", name)  # (where python was built)
            counts[name] = counts.get(name, 0) + int(m.group(1).replace(",", ""))
    return counts


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--child", choices=("hand", "phalanx"), help=argparse_hidden())
    p.add_argument("--from", dest="first", type=int, default=200, help="the first counted step")
    p.add_argument("--steps", type=int, default=100, help="counted steps")
    p.add_argument("--files", nargs=2, metavar="NAME=FILE", help="callgrind files of earlier runs (hand=, phalanx=)")
    p.add_argument("--label", default="", help="saved as loop_instructions-LABEL (e.g. the code's state)")
    args = p.parse_args()
    if args.child:
        return child(args.child, args.first, args.steps)
    if args.files:
        files = {k: Path(v) for k, v in (f.split("=", 1) for f in args.files)}
    else:
        folder = Path(tempfile.mkdtemp())
        files = {w: run_under_callgrind(w, args.first, args.steps, folder / f"cg.{w}") for w in ("hand", "phalanx")}
    counts = {w: by_function(f) for w, f in files.items()}
    totals = {w: sum(c.values()) / args.steps for w, c in counts.items()}
    extra = totals["phalanx"] - totals["hand"]
    print(f"instructions a step: hand-written {totals['hand']:,.0f}, phalanx {totals['phalanx']:,.0f} "
          f"(+{extra:,.0f}, {extra / totals['hand']:.2%}); ratio hand/phalanx {totals['hand'] / totals['phalanx']:.4f}")
    names = set(counts["hand"]) | set(counts["phalanx"])
    diff = sorted(((counts["phalanx"].get(n, 0) - counts["hand"].get(n, 0)) / args.steps, n) for n in names)
    top = [(d, n) for d, n in sorted(diff, key=lambda r: -abs(r[0]))[:25]]
    print("where the difference goes (instructions a step, phalanx - hand, by C function):")
    for d, n in top:
        print(f"  {d:+9.0f}  {n[:110]}")
    save_result("loop_instructions" + (f"-{args.label}" if args.label else ""), args,
                instructions_per_step=totals, extra_per_step=extra,
                ratio_hand_over_phalanx=totals["hand"] / totals["phalanx"],
                top_differences={n[:160]: d for d, n in top})


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
