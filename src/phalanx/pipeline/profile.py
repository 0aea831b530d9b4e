"""Measure what each block costs: forward + backward seconds on one micro-batch, on this device.

The blocks run in sequence as a stage would run them: every forward in order, then every
backward in reverse, each block timed on its own (its input is a fresh leaf, so its backward
stops there and the gradient is handed on by hand). Timing blocks one after another, rather
than each in a tight loop of its own, keeps the caches as cold as in training: a block timed
alone over and over finds its weights in cache and looks cheaper than it is.

Private copies of the blocks are timed (so the parameters' gradients and buffers such as
BatchNorm statistics stay untouched), under a forked random state (so profiling draws nothing
from the training run's random streams). One warm-up pass, then ``repeats`` timed passes; the
median is each block's cost.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Sequence

import torch
from torch import nn


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _one_pass(blocks: Sequence[nn.Module], x: torch.Tensor, device: torch.device) -> list[float]:
    inputs, outputs, seconds = [], [], []
    for block in blocks:
        inp = x.detach().requires_grad_(x.is_floating_point())
        start = _now(device)
        x = block(inp)
        seconds.append(_now(device) - start)
        inputs.append(inp)
        outputs.append(x)
    grad = torch.ones_like(x)
    for i in reversed(range(len(blocks))):
        start = _now(device)
        if outputs[i].requires_grad:
            outputs[i].backward(grad)
        seconds[i] += _now(device) - start
        grad = inputs[i].grad if inputs[i].grad is not None else torch.ones_like(inputs[i], dtype=torch.float)
        blocks[i].zero_grad(set_to_none=True)
    return seconds


def time_blocks(blocks: Sequence[nn.Module], example: torch.Tensor, device: torch.device,
                repeats: int = 5) -> list[float]:
    """Median forward+backward seconds of every block on ``example`` (one micro-batch)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        copies = [copy.deepcopy(block).train() for block in blocks]
        x = example.to(device)
        passes = [_one_pass(copies, x, device) for _ in range(repeats + 1)][1:]  # the first is the warm-up
    return [statistics.median(p[i] for p in passes) for i in range(len(blocks))]
