"""examples/gpt.py's quality under phalanx against the same model's plain PyTorch loop.

The plain loop is the one a nanoGPT user writes: the same model (``gpt.make``), data (``gpt.load``), steps,
global batch, optimizer (``model.configure_optimizers`` through ``gpt.optimizer``), schedule (``gpt.schedule``:
warmup, then cosine to a tenth) and clipping (1.0); each epoch's order drawn by ``torch.randperm`` and sliced.
Each figure is the test set's perplexity (exp of the mean cross-entropy per byte over every test window).

    python3 benchmarks/gpt_quality.py --plain-only              # the reference loop alone, against the baselines
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import char_lm  # noqa: E402  (the baselines)
import gpt  # noqa: E402

from _common import parser, save_result  # noqa: E402

CLIP = 1.0


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


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=64, help="the global batch, in windows of 64 bytes")
    p.add_argument("--seeds", type=int, default=1, help="plain runs with seeds 0..N-1")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the plain loop")
    p.add_argument("--plain-only", action="store_true", help="the reference loop alone")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    train, test = gpt.load()
    base = char_lm.baselines(train, test)
    print(f"baselines: uniform {base['uniform']:.1f}, unigram {base['unigram']:.2f}")
    plain = []
    for seed in range(args.seeds):
        plain.append(perplexity(plain_loop(args.steps, args.batch_size, seed), test))
        print(f"plain PyTorch, seed {seed}: test perplexity {plain[-1]:.3f}")
    save_result("gpt_quality", args, baselines=base, plain=plain, plain_median=statistics.median(plain))


if __name__ == "__main__":
    main()
