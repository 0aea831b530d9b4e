"""Gradient reduction as DDP communication hooks: hierarchical over islands, and compressed.

Hierarchical (``--reduce hierarchical``), per gradient bucket, with islands of ranks such as
``[[0, 1], [2, 3]]``:

1. reduce (sum) within each island onto its leader (its lowest rank);
2. all-reduce among the leaders, one per island;
3. broadcast from each leader back within its island; divide by the world size.

Only the leaders talk across islands, so the slow links carry one copy of the gradients per
island instead of one per rank. The three stages run one after another inside the hook: the
hook returns a completed future, so DDP's overlap of communication with the rest of backward is
kept between buckets but not within one.

Compression (``--compress bf16|fp16``) casts the bucket to half precision before it travels and
back to the gradient's dtype after, halving the bytes on every link; it combines with both flat
and hierarchical reduction (a flat compressed reduction is torch's own ``bf16_compress_hook`` /
``fp16_compress_hook``). gloo reduces bf16/fp16 on the CPU as well (torch 2.13), so this runs on
CPU workers too.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .errors import PhalanxError

REDUCTIONS = ("flat", "hierarchical", "auto")
COMPRESSIONS = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_islands(text: str) -> tuple[tuple[int, ...], ...]:
    """``'0,1;2,3'`` -> ((0, 1), (2, 3))."""
    try:
        return tuple(tuple(int(r) for r in part.split(",")) for part in text.split(";"))
    except ValueError:
        raise PhalanxError(f"islands {text!r} are not like '0,1;2,3' (ranks separated by commas, islands by "
                           "semicolons)") from None


def validate_islands(islands, world_size: int) -> list[list[int]]:
    """Islands must cover ranks 0..N-1 exactly once."""
    islands = [list(island) for island in islands]
    flat = sorted(r for island in islands for r in island)
    if flat != list(range(world_size)) or any(not island for island in islands):
        raise PhalanxError(
            f"islands {islands} must list every rank 0..{world_size - 1} exactly once "
            f"(they cover {flat}); e.g. [[0, 1], [2, 3]] for 4 workers"
        )
    return sorted(sorted(island) for island in islands)


@dataclasses.dataclass
class HierarchicalState:
    """Process groups for one rank's hierarchical reduction (built identically on every rank)."""

    islands: list[list[int]]
    rank: int
    world_size: int
    dtype: Optional[torch.dtype]
    island_group: Optional[dist.ProcessGroup] = None
    leaders_group: Optional[dist.ProcessGroup] = None
    leader: int = 0
    #: bytes handed to collectives by this rank (for tests and benchmarks)
    bytes_sent: int = 0

    @classmethod
    def build(cls, islands: list[list[int]], rank: int, world_size: int, dtype: Optional[torch.dtype] = None
              ) -> "HierarchicalState":
        islands = validate_islands(islands, world_size)
        state = cls(islands, rank, world_size, dtype)
        # new_group is itself a collective: every rank creates every group, in the same order.
        for island in islands:
            group = dist.new_group(island)
            if rank in island:
                state.island_group, state.leader = group, island[0]
        state.leaders_group = dist.new_group([island[0] for island in islands])
        return state

    def reduce(self, flat: torch.Tensor) -> torch.Tensor:
        """The sum over all ranks of ``flat`` (in place), via island leaders."""
        wire = flat.to(self.dtype) if self.dtype is not None else flat
        count = wire.numel() * wire.element_size()
        dist.reduce(wire, dst=self.leader, group=self.island_group)
        self.bytes_sent += count
        if self.rank == self.leader and len(self.islands) > 1:
            dist.all_reduce(wire, group=self.leaders_group)
            self.bytes_sent += count
        dist.broadcast(wire, src=self.leader, group=self.island_group)
        self.bytes_sent += count
        if wire is not flat:
            flat.copy_(wire)
        return flat


def hierarchical_hook(state, bucket):  # no annotations: DDP checks them, and they would be strings here
    """DDP communication hook: the bucket averaged over all ranks, island by island."""
    averaged = state.reduce(bucket.buffer()).div_(state.world_size)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(averaged)
    return future


def choose_reduction(reduce: str, islands: Optional[list[list[int]]]) -> str:
    """``auto`` picks hierarchical where islands exist and at least one holds several ranks."""
    if reduce not in REDUCTIONS:
        raise PhalanxError(f"unknown --reduce {reduce!r}: choose one of {', '.join(REDUCTIONS)}")
    if reduce != "auto":
        return reduce
    useful = islands is not None and len(islands) > 1 and any(len(i) > 1 for i in islands)
    return "hierarchical" if useful else "flat"


def apply_reduction(ddp_model, reduce: str, compress: Optional[str], islands: Optional[list[list[int]]],
                    world_size: int, rank: int) -> str:
    """Register the right communication hook on ``ddp_model``; return a phrase for the run header."""
    if compress not in COMPRESSIONS:
        raise PhalanxError(f"unknown --compress {compress!r}: choose bf16 or fp16")
    kind = choose_reduction(reduce, islands)
    if kind == "hierarchical":
        if islands is None:
            raise PhalanxError("--reduce hierarchical needs islands: on GPUs they come from the topology "
                               "(phalanx topology); in the API pass Sync(islands=[[0, 1], [2, 3]])")
        state = HierarchicalState.build(islands, rank, world_size, COMPRESSIONS[compress])
        ddp_model.register_comm_hook(state, hierarchical_hook)
        described = f"hierarchical over islands {state.islands}"
    elif compress is not None:
        hook = default_hooks.bf16_compress_hook if compress == "bf16" else default_hooks.fp16_compress_hook
        ddp_model.register_comm_hook(None, hook)
        described = "flat all-reduce"
    else:
        described = "flat all-reduce"
    return described + (f", {compress} on the wire" if compress else "")
