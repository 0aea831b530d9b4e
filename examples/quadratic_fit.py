"""Fit y = 5x² + 3 with ŷ = [x², x, 1]·w on two towers that share w.

    python3 examples/quadratic_fit.py            # prints w = [5.000, 0.000, 3.001]

Each step draws 100 samples from U(-10, 10); make_parallel splits them 50/50 between the towers,
each tower computes its half, the gradients of both land in the one w, Adam takes one step.
The constant term is the slow one (its feature, 1, is tiny beside x² up to 100), so the default
of 2,500 steps is what it takes to land within 0.01 of every coefficient.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import phalanx


class Quadratic(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.stack([x * x, x, torch.ones_like(x)], dim=1)
        return (features @ self.w).squeeze(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--towers", type=int, default=2, help="towers (GPUs where there are enough, else CPU)")
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    towers = args.towers if phalanx.devices.cuda_count() >= args.towers else ["cpu"] * args.towers
    model = Quadratic()
    par = phalanx.make_parallel(model, towers)
    opt = torch.optim.Adam(par.parameters(), lr=args.lr)
    for step in range(1, args.steps + 1):
        x = torch.empty(args.batch).uniform_(-10, 10)
        loss = (par(x) - (5 * x * x + 3)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 500 == 0:
            print(f"step {step}, loss = {loss.item():.4f}")
    w = model.w.detach().squeeze(1).tolist()
    print(f"towers: {', '.join(str(d) for d in par.devices)}")
    print("w = [" + ", ".join(f"{v:.3f}" for v in w) + "]")


if __name__ == "__main__":
    main()
