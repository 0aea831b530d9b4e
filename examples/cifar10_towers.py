"""The classic multi-tower CIFAR-10 training loop, in one process, with make_parallel.

    python3 examples/cifar10_towers.py                                  # made-up gratings, 2 towers, 150 steps
    python3 examples/cifar10_towers.py --data-dir ~/cifar-10-batches-bin --steps 5000 --towers 2

Each tower runs the tutorial network (conv 5x5x64, max-pool, LRN, conv 5x5x64, LRN, max-pool,
fc 384, fc 192, fc 10) on its slice of the batch and computes the loss of its examples; the
losses are averaged over the whole batch, so the gradients of all towers are averaged into the
one set of parameters, and one SGD step is taken (momentum 0.9).

Without ``--data-dir`` it trains on :func:`gratings`, made here: CIFAR-10 itself is a 162 MB
download that neither phalanx nor its dependencies ship, and the machines this example is tested
on have no network. Gratings are CIFAR-shaped images of 10 classes (stripes of 5 frequencies, two
directions, random phase, colour and contrast, under noise) through the real data's pipeline
(random crops, flips, standardisation): chance is 0.10, and the defaults (150 steps of 64 images,
lr 0.01) end at test accuracy 0.978, measured on 2 CPU cores (about 0.5 s a step when they are
free, 1.7 s when shared with other jobs). The loss stays near 2.30 for the first 50 steps or so,
then falls fast. Random inputs with random labels, phalanx's own ``--data synthetic``, would end
at chance, as the earlier default did (0.11): they have nothing a network can generalise from.

With the real files (the "CIFAR-10 binary version", ``data_batch_1.bin`` .. ``test_batch.bin``), not
measured here: the TensorFlow tutorial this network and input pipeline come from reports a peak of
about 0.86 test accuracy after hours of training on a GPU (batches of 128, a decaying learning rate,
weight decay); this loop keeps the rate constant and has no weight decay, so expect less than that,
and a good deal less within a few thousand steps.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx.data import ArrayDataset, DataBundle, ShardedBatches, eval_batches, load_cifar10
from phalanx.data.datasets import CIFAR_CROP, cifar_augment_params, cifar_eval_transform, cifar_train_transform
from phalanx.task.models import build_model


def gratings(size: int = 2048, seed: int = 0) -> DataBundle:
    """CIFAR-10-shaped images of 10 classes a network can tell apart, made here (no download).

    Class c is a grating (stripes): horizontal for even c, vertical for odd, at 2, 3, 4.5, 6.5 or 9
    cycles per 32 pixels (c // 2), at a random phase and contrast, in a random colour, under Gaussian
    noise as strong as the stripes. Stored as 32x32 uint8 images like the real files, so they go through
    the same input pipeline: random 24x24 crops and horizontal flips (neither changes a grating's
    direction or frequency) and per-image standardisation.
    """
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(size) % 10
    labels = labels[torch.randperm(size, generator=gen)]
    cycles = torch.tensor([2.0, 3.0, 4.5, 6.5, 9.0])[labels // 2]
    phase = torch.rand(size, generator=gen) * 2 * math.pi
    along = torch.arange(32.0)
    wave = torch.sin(2 * math.pi * cycles[:, None] * along / 32 + phase[:, None])  # (N, 32)
    stripes = torch.where((labels % 2 == 0)[:, None, None], wave[:, :, None].expand(-1, 32, 32),
                          wave[:, None, :].expand(-1, 32, 32))
    contrast = 0.5 + torch.rand(size, 1, 1, 1, generator=gen)
    colour = torch.rand(size, 3, 1, 1, generator=gen) + 0.2
    images = contrast * colour * stripes[:, None] + torch.randn(size, 3, 32, 32, generator=gen)
    raw = (128 + 40 * images).clamp(0, 255).to(torch.uint8)
    n_test = size // 5
    return DataBundle(
        "gratings", ArrayDataset(raw[n_test:], labels[n_test:], cifar_train_transform, cifar_augment_params),
        ArrayDataset(raw[:n_test], labels[:n_test], cifar_eval_transform), (3, CIFAR_CROP, CIFAR_CROP), 10)


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
    p.add_argument("--data-dir", help="CIFAR-10 binary files (default: gratings(), made here, of the same shape)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split across the towers")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args()

    try:
        data = load_cifar10(args.data_dir) if args.data_dir else gratings()
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
