"""Measure what each block costs: forward + backward seconds on one micro-batch, on this device.

Each block runs on a private copy (so its parameters' gradients and its buffers, such as
BatchNorm statistics, stay untouched) fed the previous block's output, under a forked random
state (so profiling draws nothing from the training run's random streams). One warm-up pass,
then ``repeats`` timed passes; the median is the block's cost.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Sequence

import torch
from torch import nn


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_block(block: nn.Module, x: torch.Tensor, device: torch.device, repeats: int) -> tuple[float, torch.Tensor]:
    samples = []
    out = x
    for i in range(repeats + 1):
        inp = x.detach().requires_grad_(x.is_floating_point())
        _sync(device)
        start = time.perf_counter()
        out = block(inp)
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        _sync(device)
        if i:  # the first pass is the warm-up
            samples.append(time.perf_counter() - start)
        block.zero_grad(set_to_none=True)
    return statistics.median(samples), out.detach()


def time_blocks(blocks: Sequence[nn.Module], example: torch.Tensor, device: torch.device,
                repeats: int = 5) -> list[float]:
    """Median forward+backward seconds of every block on ``example`` (one micro-batch)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        x = example.to(device)
        costs = []
        for block in blocks:
            cost, x = _time_block(copy.deepcopy(block).train(), x, device, repeats)
            costs.append(cost)
    return costs
