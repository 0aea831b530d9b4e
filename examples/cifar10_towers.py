"""The classic multi-tower CIFAR-10 training loop, in one process, with make_parallel.

    python3 examples/cifar10_towers.py                                  # synthetic data, 2 towers, 20 steps
    python3 examples/cifar10_towers.py --data-dir ~/cifar-10-batches-bin --steps 2000 --towers 2

Each tower runs the tutorial network (conv 5x5x64, max-pool, LRN, conv 5x5x64, LRN, max-pool,
fc 384, fc 192, fc 10) on its slice of the batch and computes the loss of its examples; the
losses are averaged over the whole batch, so the gradients of all towers are averaged into the
one set of parameters, and one SGD step is taken.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.data import ShardedBatches, eval_batches, load_cifar10, load_synthetic
from phalanx.models import build_model


class TowerLoss(nn.Module):
    """What one tower computes: the per-example loss of its slice."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(images), labels, reduction="none")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--towers", type=int, default=2, help="towers (GPUs where there are enough, else CPU)")
    p.add_argument("--data-dir", help="CIFAR-10 binary files (default: synthetic data of the same shape)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split across the towers")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args()

    try:
        data = load_cifar10(args.data_dir) if args.data_dir else load_synthetic((3, 24, 24), size=2048)
    except phalanx.PhalanxError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    gpus = phalanx.devices.cuda_count()
    towers = args.towers if gpus >= args.towers else ["cpu"] * args.towers
    torch.manual_seed(0)
    model = build_model("cifar10", data.input_shape, data.num_classes)
    if gpus:
        model = model.cuda()
    par = phalanx.make_parallel(TowerLoss(model), towers)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    print(f"{data.name}: {len(data.train)} training images, towers on {', '.join(map(str, par.devices))}")

    batches = ShardedBatches(data.train, args.batch_size)(0)
    mark = time.perf_counter()
    for step in range(1, args.steps + 1):
        images, labels = next(batches)
        loss = par(images, labels).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % args.log_every == 0:
            seconds = (time.perf_counter() - mark) / args.log_every
            print(f"step {step}, loss = {loss.item():.2f} ({args.batch_size / seconds:.1f} examples/sec; "
                  f"{seconds:.3f} sec/batch)", flush=True)
            mark = time.perf_counter()

    model.eval()
    with torch.no_grad():
        correct = sum((model(x.to(next(model.parameters()).device)).argmax(1).cpu() == y).sum().item()
                      for x, y in eval_batches(data.test, 500))
    print(f"test accuracy {correct / len(data.test):.4f}")


if __name__ == "__main__":
    main()
