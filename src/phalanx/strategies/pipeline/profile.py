"""Measure what each block costs where its stage will run: forward + backward seconds per micro-batch.

Who runs it: every rank of a pipeline, inside its own worker process, before the partition
exists (so every rank times every block; :func:`agree` then gives all ranks the same figures).
The conditions are the stage's:

- the worker's own torch threads and device (the process it trains in, not the parent);
- micro-batches of the size the schedule feeds (the batch / M), M of them per pass, in the
  schedule's order on a CPU: GPipe runs every forward, then every backward, so a block's
  activations of all M micro-batches are alive and fall out of the caches before its backward
  reads them; 1F1B runs each micro-batch's forward and backward close together (see
  :func:`profile_order` for accelerators);
- every rank timing at the same moment (``barrier`` before each pass): in training all stages
  compute at once and share the node's cores, memory bandwidth and caches;
- warm (``warmup`` untimed passes first: allocator, kernels, caches), and gradients
  accumulating across micro-batches as in a step (cleared once per pass, as ``zero_grad`` does);
  a fresh gradient per micro-batch would charge a large layer the first touch of its gradient
  every time.

Each block is timed on its own inside the pass (its input is a fresh leaf, so its backward stops
there and the gradient is handed on by hand; the block is given an untimed copy of that leaf, so a
block that works in place, as torchvision's ``ReLU(inplace=True)`` does, runs as inside a stage).
Private copies of the blocks are timed (the parameters' gradients and buffers such as BatchNorm
statistics stay untouched), under a forked random state (profiling draws nothing from the
training run's random streams). Every block's cost is the median over ``repeats`` passes.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from typing import Callable, Optional, Sequence

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class BlockTimes:
    """One rank's measurement: per block, forward+backward seconds per micro-batch, and output size."""

    seconds: list[float]  #: median over the timed passes, per micro-batch
    output_bytes: list[int]  #: bytes of each block's output for one micro-batch (what a cut after it sends)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _forward(blocks: Sequence[nn.Module], x: torch.Tensor, device: torch.device, seconds: list[float]):
    """One micro-batch through every block; returns each block's (input leaf, output)."""
    pairs = []
    for i, block in enumerate(blocks):
        inp = x.detach().requires_grad_(x.is_floating_point())
        # The block gets a copy: a leaf that requires grad refuses in-place ops (torchvision's ReLU(inplace=True)),
        # which the unsplit model applies to an intermediate tensor and a stage to a copy of what it received.
        feed = inp.clone()
        start = _now(device)
        x = block(feed)
        seconds[i] += _now(device) - start
        pairs.append((inp, x))
    return pairs


def _backward(blocks: Sequence[nn.Module], pairs, device: torch.device, seconds: list[float]) -> None:
    """The micro-batch's backward, last block first, each block's input gradient handed on by hand."""
    grad = torch.ones_like(pairs[-1][1])
    for i in reversed(range(len(blocks))):
        inp, out = pairs[i]
        start = _now(device)
        if out.requires_grad:
            out.backward(grad)
        seconds[i] += _now(device) - start
        grad = inp.grad if inp.grad is not None else torch.ones_like(inp, dtype=torch.float)


def _one_pass(blocks: Sequence[nn.Module], micro: Sequence[torch.Tensor], device: torch.device,
              schedule: str) -> list[float]:
    """Seconds per micro-batch of every block, over the micro-batches in ``schedule``'s order."""
    seconds = [0.0] * len(blocks)
    if schedule == "gpipe":
        alive = [_forward(blocks, x, device, seconds) for x in micro]
        for pairs in alive:
            _backward(blocks, pairs, device, seconds)
    else:
        for x in micro:
            _backward(blocks, _forward(blocks, x, device, seconds), device, seconds)
    for block in blocks:
        block.zero_grad(set_to_none=True)
    return [s / len(micro) for s in seconds]


def time_blocks(blocks: Sequence[nn.Module], micro: Sequence[torch.Tensor], device: torch.device,
                repeats: int = 5, *, schedule: str = "gpipe", warmup: int = 1,
                barrier: Optional[Callable[[], None]] = None) -> BlockTimes:
    """This rank's median forward+backward seconds of every block per micro-batch (see the module docstring).

    ``micro``: one step's micro-batches, as the schedule cuts them; ``barrier``: called before
    every pass so that all ranks time at once (None in one process).
    """
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        copies = [copy.deepcopy(block).to(device).train() for block in blocks]
        xs = [x.to(device) for x in micro]
        with torch.no_grad():
            outputs = [out for _, out in _forward(copies, xs[0], device, [0.0] * len(copies))]
        sizes = [out.nelement() * out.element_size() for out in outputs]
        passes = []
        for _ in range(warmup + repeats):
            if barrier is not None:
                barrier()
            passes.append(_one_pass(copies, xs, device, schedule))
    timed = passes[warmup:]
    return BlockTimes([statistics.median(p[i] for p in timed) for i in range(len(blocks))], sizes)


def agree(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Every rank's figure per block: the median over the ranks' measurements (a rank disturbed by
    something else on its node moves it least). Pure: ranks that all-gathered the same rows compute
    the same numbers, hence the same partition."""
    blocks = {len(row) for row in per_rank}
    if len(blocks) != 1:
        raise ValueError(f"ranks measured different numbers of blocks: {sorted(blocks)}")
    return [float(statistics.median(row[i] for row in per_rank)) for i in range(blocks.pop())]


def profile_order(schedule: str, device: torch.device) -> str:
    """The order blocks are timed in: the schedule's on a CPU, where GPipe's M live micro-batches push
    activations out of the caches; micro-batch by micro-batch on an accelerator, where activations
    stay in device memory either way and M micro-batches of the *whole* model's activations (every
    rank times every block) could outgrow the one device the stage will run on."""
    return schedule if device.type == "cpu" else "1f1b"


def describe(device: torch.device, micro: Sequence[torch.Tensor], schedule: str, repeats: int, ranks: int,
             distributed: bool) -> str:
    """How the block times were measured, as the plan prints it."""
    where = "in every worker at once" if distributed else "in this process"
    threads = torch.get_num_threads()
    on = f"{threads} torch thread{'s' if threads > 1 else ''} each on cpu" if device.type == "cpu" else str(device)
    agreed = f"; median over {ranks} ranks" if ranks > 1 else ""
    return (f"{where}: {on}, {len(micro)} micro-batches of {len(micro[0])} per pass in "
            f"{profile_order(schedule, device)} order, median of {repeats} passes after a warm-up{agreed}")
