"""Stage balancing: cut a sequence of blocks into contiguous stages, as evenly as possible.

Pure logic, no processes. A pipeline runs at the pace of its slowest stage, so the partition
minimises the largest stage cost (the bottleneck). :func:`partition` solves that exactly by
dynamic programming over (stages used, blocks covered): O(P·n²) for P stages and n blocks,
instant for any model with a few hundred blocks. Costs are whatever the caller measured per
block: parameter counts (memory) or forward+backward seconds per micro-batch (speed).

A stage also pays for its boundaries: per micro-batch it receives (and sends) the activations
at the cut before it and the gradients at the cut after it. ``boundary[k]``, when given, is that
cost per micro-batch and adjacent stage for a cut after block k (it depends on the size of block
k's output); it is added to both stages beside the cut, so the partition weighs compute against
where the messages are small. Every rank that gives the same costs gets the same partition.

The predicted step of a fill-drain schedule (GPipe; 1F1B has the same bubble and holds fewer
activations) with per-micro-batch stage costs c_1..c_P and M micro-batches:
T = Σ c_s + (M − 1)·max c_s + 2·Σ h_b (the first micro-batch crosses every stage, and every
boundary b once each way with latency h_b; the rest follow at the bottleneck's pace). Stage s is
busy M·c_s of it, so the idle share (the bubble) is 1 − M·Σ c_s / (P·T). For equal stages and
free messages it is the textbook (P − 1)/(M + P − 1).
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

from ..errors import PhalanxError

#: How ``--balance`` may be given: one of these words, or explicit block counts ("3,2,2").
BALANCE_MODES = ("auto", "params", "time")

Balance = Union[str, tuple[int, ...]]


def parse_balance(value: Union[str, Sequence[int]]) -> Balance:
    """``"auto" | "params" | "time"`` stay words; ``"3,2,2"`` or ``[3, 2, 2]`` become block counts."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in BALANCE_MODES:
            return text
        try:
            counts = tuple(int(part) for part in text.split(","))
        except ValueError:
            raise PhalanxError(
                f"unknown --balance {value!r}: choose auto, params, time, or block counts per stage like 3,2,2"
            ) from None
    else:
        counts = tuple(int(c) for c in value)
    if not counts or any(c < 1 for c in counts):
        raise PhalanxError(f"--balance {','.join(map(str, counts))}: every stage needs at least one block")
    return counts


def check_counts(counts: Sequence[int], blocks: int, stages: int) -> None:
    """An explicit balance must give every stage at least one block and cover every block once."""
    shown = ",".join(map(str, counts))
    if len(counts) != stages:
        raise PhalanxError(f"--balance {shown} names {len(counts)} stages but the pipeline has {stages}; "
                           f"give one block count per stage")
    if any(c < 1 for c in counts):
        raise PhalanxError(f"--balance {shown}: every stage needs at least one block")
    if sum(counts) != blocks:
        raise PhalanxError(f"--balance {shown} sums to {sum(counts)} ({' + '.join(map(str, counts))}) but the "
                           f"model has {blocks} blocks; make the counts add up to {blocks}")


def check_stages(blocks: int, stages: int) -> None:
    if stages < 1:
        raise PhalanxError(f"--stages must be at least 1, got {stages}")
    if stages > blocks:
        raise PhalanxError(f"{stages} stages but the model has only {blocks} blocks: every stage needs at least one "
                           f"block; use --stages {blocks} or fewer, or split the model into more blocks")


def partition(costs: Sequence[float], stages: int, boundary: Optional[Sequence[float]] = None) -> tuple[int, ...]:
    """Blocks per stage for the contiguous partition whose most expensive stage is cheapest.

    Exact (dynamic programming). A stage's cost is its blocks' costs plus, with ``boundary``
    (one figure per block: the cost of a cut after it), the cuts at either end of the stage.
    Among optimal partitions it returns the one whose cuts come earliest, so every rank given the
    same costs computes the same plan.
    """
    n = len(costs)
    check_stages(n, stages)
    edge = _edges(boundary, n)
    prefix = [0.0] + list(itertools.accumulate(float(c) for c in costs))
    inf = float("inf")
    # best[k][j]: the smallest bottleneck covering blocks [0, j) with k stages; cut[k][j]: where stage k starts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i] + edge[i] + edge[j])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    counts, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return tuple(reversed(counts))


def _edges(boundary: Optional[Sequence[float]], blocks: int) -> list[float]:
    """edge[j]: the cost a stage pays for a cut before block j (0 at either end of the model)."""
    if boundary is None:
        return [0.0] * (blocks + 1)
    if len(boundary) != blocks:
        raise ValueError(f"boundary costs: {len(boundary)} given for {blocks} blocks")
    return [0.0] + [float(b) for b in boundary[:-1]] + [0.0]


def stage_costs(costs: Sequence[float], counts: Sequence[int],
                boundary: Optional[Sequence[float]] = None) -> list[float]:
    """The cost of each stage under ``counts`` blocks per stage: its blocks, and with ``boundary``
    the cuts at its ends (as in :func:`partition`)."""
    edge = _edges(boundary, len(costs))
    return [float(sum(costs[lo:hi])) + edge[lo] + edge[hi] for lo, hi in bounds(counts)]


def bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """(first block, one past the last) of every stage."""
    starts = [0] + list(itertools.accumulate(counts))
    return list(zip(starts[:-1], starts[1:]))


def predicted_step(per_stage: Sequence[float], micro_batches: int, latency: Sequence[float] = ()) -> float:
    """Seconds of one fill-drain step: Σ c_s + (M − 1)·max c_s + 2·Σ h_b (see the module docstring)."""
    if not per_stage:
        return 0.0
    return sum(per_stage) + (micro_batches - 1) * max(per_stage) + 2 * sum(latency)


def predicted_bubble(per_stage: Sequence[float], micro_batches: int, latency: Sequence[float] = ()) -> float:
    """The idle share of a fill-drain step (see the module docstring); 0 for one stage."""
    stages = len(per_stage)
    if stages <= 1 or sum(per_stage) <= 0:
        return 0.0 if stages <= 1 else ideal_bubble(stages, micro_batches)
    step = predicted_step(per_stage, micro_batches, latency)
    return 1.0 - micro_batches * sum(per_stage) / (stages * step)


def ideal_bubble(stages: int, micro_batches: int) -> float:
    """(P − 1)/(M + P − 1): the bubble of P equal stages and M micro-batches."""
    return (stages - 1) / (micro_batches + stages - 1)
