"""The strategy's step against a hand-written one, in CPU time: what a batch of any structure costs per step.

``loop_overhead.py`` times whole loops by the wall clock, which on a machine shared with other jobs moves by
2x from run to run. This one times one call of a step by the CPU time of the thread that runs it
(``time.thread_time``), which other processes barely move, in one process, the variants interleaved:

- ``hand-written``: ``F.cross_entropy(model(x), y).backward(); opt.step(); opt.zero_grad()``;
- ``phalanx pair``: ``runtime.train_step((x, y))`` of a one-process ``Sync`` runtime, the default step;
- ``phalanx dict``: the same model behind keyword inputs and its own loss, ``runtime.train_step({...})``
  (a dict batch, ``model(**batch)``, the output's ``loss``), against ``hand-written dict``, the same calls by hand.

The model is tiny on purpose (a linear layer on 64 features, batch 32), so that bookkeeping is the largest share
of a step it will ever be.

    python3 benchmarks/step_overhead.py --rounds 7 --steps 2000 --save
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from phalanx import Sync
from phalanx.launcher import WorkerContext
from phalanx.strategies import runtime_for

from _common import parser, print_medians, save_result


class Keywords(nn.Module):
    """A linear classifier with Hugging Face's calling convention: keyword inputs, a dict with its own loss."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, inputs, labels=None):
        logits = self.fc(inputs)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def sgd(params):
    return torch.optim.SGD(params, lr=0.01)


def variants(batch: int) -> dict:
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    ctx = WorkerContext(0, 1, 0, torch.device("cpu"), None)
    torch.manual_seed(0)
    plain, keywords = nn.Linear(64, 10), Keywords()
    hand_opt, hand_kw_opt = sgd(plain.parameters()), sgd(keywords.parameters())
    pair = runtime_for(Sync(), ctx, nn.Linear(64, 10), sgd, example=(x, y))
    words = runtime_for(Sync(), ctx, Keywords(), sgd, example={"inputs": x, "labels": y})

    def hand():
        F.cross_entropy(plain(x), y).backward()
        hand_opt.step()
        hand_opt.zero_grad(set_to_none=True)

    def hand_dict():
        keywords(**{"inputs": x, "labels": y})["loss"].backward()
        hand_kw_opt.step()
        hand_kw_opt.zero_grad(set_to_none=True)

    return {"hand-written": hand, "phalanx pair": lambda: pair.train_step((x, y)),
            "hand-written dict": hand_dict, "phalanx dict": lambda: words.train_step({"inputs": x, "labels": y})}


def cpu_us(call, steps: int) -> float:
    began = time.thread_time()
    for _ in range(steps):
        call()
    return (time.thread_time() - began) / steps * 1e6


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=2000, help="timed steps per variant per round")
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)
    calls = variants(args.batch)
    for call in calls.values():  # warm-up: allocator, autograd's first graph
        cpu_us(call, 200)
    runs: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            runs[name].append(cpu_us(call, args.steps))
    print(f"linear 64->10, batch {args.batch}, 1 thread, {args.steps} steps x {args.rounds} rounds, CPU us a step "
          "(median, min-max)")
    med = print_medians(runs, 18, " us")
    ratios = {"pair": med["hand-written"] / med["phalanx pair"],
              "dict": med["hand-written dict"] / med["phalanx dict"]}
    paired = {kind: statistics.median(h / p for h, p in zip(runs[hand], runs[mine]))
              for kind, hand, mine in (("pair", "hand-written", "phalanx pair"),
                                       ("dict", "hand-written dict", "phalanx dict"))}
    for kind in ratios:
        print(f"  speed phalanx/hand-written, {kind} batches: {ratios[kind]:.3f} (paired per round "
              f"{paired[kind]:.3f})")
    save_result("step_overhead", args, cpu_us_per_step=runs, median=med, speed_ratio=ratios, paired_ratio=paired)


if __name__ == "__main__":
    main()
