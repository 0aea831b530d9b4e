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
and hierarchical reduction. It is torch's ``bf16_compress_hook`` with one change: the half-precision
buffers are kept from step to step (:class:`WireBuffers`) instead of allocated per bucket per step.
gloo reduces bf16/fp16 on the CPU as well (torch 2.13), so this runs on CPU workers too, but gloo
adds fp16 element by element (slower than fp32) and on loopback a byte costs about as much to cast
as to send: see docs/topology.md for what it saves where.

A flat reduction without compression registers no hook at all: DDP's C++ reducer all-reduces its
buckets itself, and :class:`CountedAllReduce` prices them on the wire meter (``wire.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from . import wire
from ..errors import PhalanxError
from ..kinds import Kind

#: the words of --reduce (see :class:`Reduce`)
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


def degenerate(islands: list[list[int]]) -> Optional[str]:
    """Why reducing island by island would do nothing a flat all-reduce does not (None: it would)."""
    if len(islands) == 1:
        return "a single island"
    if all(len(island) == 1 for island in islands):
        return "one rank per island"
    return None


class WireBuffers:
    """Half-precision buffers kept from step to step, one per bucket shape.

    Casting a gradient bucket into a *fresh* tensor every step costs a page-faulting allocation
    as large as the bucket, more than the all-reduce saves (the figure: benchmarks/README.md, "Figures
    behind the code"); copying into a buffer that stays costs only the conversion.
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.buffers: dict[tuple, torch.Tensor] = {}

    def cast(self, flat: torch.Tensor) -> torch.Tensor:
        key = (flat.numel(), flat.device)
        wire = self.buffers.get(key)
        if wire is None:
            wire = self.buffers[key] = torch.empty(flat.numel(), dtype=self.dtype, device=flat.device)
        return wire.copy_(flat)


@dataclasses.dataclass
class CompressState:
    """A flat all-reduce of each bucket in half precision (the state of :func:`compress_hook`)."""

    wire: WireBuffers
    world_size: int


def compress_hook(state, bucket):  # no annotations: DDP checks them, and they would be strings here
    """DDP communication hook: the bucket averaged over all ranks, travelling in half precision."""
    flat = bucket.buffer()
    wire = state.wire.cast(flat).div_(state.world_size)  # divided first: fp16 sums must not overflow
    future = dist.all_reduce(wire, async_op=True).get_future()

    def back(done):
        done.value()  # a failed all-reduce (a peer lost) fails the step; unread, DDP took the bucket as reduced
        return flat.copy_(wire)

    return future.then(back)


@dataclasses.dataclass
class HierarchicalState:
    """Process groups for one rank's hierarchical reduction (built identically on every rank)."""

    islands: list[list[int]]
    rank: int
    world_size: int
    dtype: Optional[torch.dtype]
    island_group: Optional[dist.ProcessGroup] = None
    wire: Optional[WireBuffers] = None
    leaders_group: Optional[dist.ProcessGroup] = None
    leader: int = 0

    @classmethod
    def build(cls, islands: list[list[int]], rank: int, world_size: int, dtype: Optional[torch.dtype] = None
              ) -> "HierarchicalState":
        islands = validate_islands(islands, world_size)
        state = cls(islands, rank, world_size, dtype, wire=WireBuffers(dtype) if dtype is not None else None)
        # new_group is itself a collective: every rank creates every group, in the same order.
        for island in islands:
            group = dist.new_group(island)
            if rank in island:
                state.island_group, state.leader = group, island[0]
        state.leaders_group = dist.new_group([island[0] for island in islands])
        return state

    def reduce(self, flat: torch.Tensor) -> torch.Tensor:
        """The sum over all ranks of ``flat`` (in place), via island leaders.

        Where the islands give the hierarchy nothing to do (one island, or one rank each) this is
        the flat all-reduce itself, so choosing hierarchical never costs there.
        """
        wire = self.wire.cast(flat) if self.wire is not None else flat
        if degenerate(self.islands):
            dist.all_reduce(wire)
            return flat.copy_(wire) if wire is not flat else flat
        dist.reduce(wire, dst=self.leader, group=self.island_group)
        if self.rank == self.leader and len(self.islands) > 1:
            dist.all_reduce(wire, group=self.leaders_group)
        dist.broadcast(wire, src=self.leader, group=self.island_group)
        if wire is not flat:
            flat.copy_(wire)
        return flat


def hierarchical_hook(state, bucket):  # no annotations: DDP checks them, and they would be strings here
    """DDP communication hook: the bucket averaged over all ranks, island by island."""
    averaged = state.reduce(bucket.buffer()).div_(state.world_size)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(averaged)
    return future


def reduced_bytes(ddp_model) -> int:
    """The bytes DDP all-reduces per synchronised backward: every bucket once, i.e. the gradients of the
    parameters it reduces (those that require grad, less those it was told to ignore; shared ones once)."""
    return sum(p.numel() * p.element_size() for name, p in ddp_model.module.named_parameters()
               if p.requires_grad and name not in ddp_model.parameters_to_ignore)


class CountedAllReduce:
    """DDP's own all-reduce, priced on the wire meter without a communication hook (a forward pre-hook).

    A forward pass with gradients on and outside ``no_sync`` arms DDP's reducer (the condition below is
    DDP's own): the backward that follows all-reduces every bucket once, so one all-reduce of
    :func:`reduced_bytes` is counted there; inner micro-batches under ``no_sync`` count nothing. Why not
    torch's ``allreduce_hook``, which sends the buckets through ``dist.all_reduce`` where they are
    counted: it cost 1.6-3.2% of a DDP step, and a lost peer's error came out of its callback on gloo's
    thread (``Got the following error when running the callback``), not out of the reducer.
    """

    def __init__(self, ddp_model):
        self.nbytes = reduced_bytes(ddp_model)
        self.size = ddp_model.process_group.size()

    def __call__(self, ddp_model, args) -> None:
        if torch.is_grad_enabled() and ddp_model.require_backward_grad_sync:
            wire.count("all_reduce", self.nbytes, self.size)


class Reduce(Kind):
    """Which reduction a DDP model runs (``--reduce``)."""

    FLAT = "flat"  #: one all-reduce over every rank
    HIERARCHICAL = "hierarchical"  #: within islands, then across their leaders
    AUTO = "auto"  #: hierarchical where the topology gives it something to win, else flat


@dataclasses.dataclass(frozen=True)
class Applied:
    """What :func:`apply_reduction` registered on a DDP model; :attr:`phrase` is for display only."""

    reduce: Reduce  #: what runs: FLAT or HIERARCHICAL (``auto`` resolved)
    compress: Optional[str]  #: the gradients' dtype on the wire (None: their own)
    islands: Optional[list[list[int]]] = None  #: the islands asked for (validated), where any were
    #: why islands asked for run flat all the same (None: none were asked for, or they are used)
    fallback: Optional[str] = None
    cpu: bool = False  #: on CPU workers (gloo adds fp16 slowly there)

    @property
    def plain(self) -> bool:
        """DDP as it comes: its own flat all-reduce in full precision, as asked (nothing for a header to add)."""
        return self.reduce is Reduce.FLAT and self.compress is None and self.fallback is None

    @property
    def phrase(self) -> str:
        """How the run header says it: ``hierarchical over islands [[0, 1], [2, 3]], bf16 on the wire``."""
        if self.reduce is Reduce.HIERARCHICAL:
            said = f"hierarchical over islands {self.islands}"
        elif self.fallback is not None:
            said = f"flat all-reduce (islands {self.islands}: {self.fallback}, nothing to reduce hierarchically)"
        else:
            said = "flat all-reduce"
        if self.compress == "fp16" and self.cpu:
            return said + ", fp16 on the wire (gloo adds fp16 slowly on the CPU: bf16 is faster there)"
        return said + (f", {self.compress} on the wire" if self.compress else "")


def choose_reduction(reduce: str, islands: Optional[list[list[int]]], cpu: bool = False) -> Reduce:
    """``auto`` picks hierarchical only where the topology gives it something to win.

    That is GPUs in several islands, one of which holds several ranks: the links between islands
    are slower than those within. CPU workers on one machine all talk over the same memory, so
    ``auto`` keeps them flat.
    """
    if reduce not in REDUCTIONS:
        raise PhalanxError(f"unknown --reduce {reduce!r}: choose one of {', '.join(REDUCTIONS)}")
    if reduce != Reduce.AUTO:
        return Reduce(reduce)
    useful = not cpu and islands is not None and degenerate([list(i) for i in islands]) is None
    return Reduce.HIERARCHICAL if useful else Reduce.FLAT


def apply_reduction(ddp_model, reduce: str, compress: Optional[str], islands: Optional[list[list[int]]],
                    world_size: int, rank: int, cpu: bool = False) -> Applied:
    """Register the right communication hook on ``ddp_model`` (none for a flat all-reduce in full precision:
    DDP's own reducer, counted by :class:`CountedAllReduce`); return what was registered."""
    if compress not in COMPRESSIONS:
        raise PhalanxError(f"unknown --compress {compress!r}: choose bf16 or fp16")
    if choose_reduction(reduce, islands, cpu) is Reduce.FLAT:
        _flat(ddp_model, compress, world_size)
        return Applied(Reduce.FLAT, compress, cpu=cpu)
    if islands is None:
        raise PhalanxError("--reduce hierarchical needs islands: on GPUs they come from the topology "
                           "(phalanx topology); in the API pass Sync(islands=[[0, 1], [2, 3]])")
    islands = validate_islands(islands, world_size)
    why = degenerate(islands)
    if why is not None:
        _flat(ddp_model, compress, world_size)
        return Applied(Reduce.FLAT, compress, islands, why, cpu)
    state = HierarchicalState.build(islands, rank, world_size, COMPRESSIONS[compress])
    ddp_model.register_comm_hook(state, hierarchical_hook)
    return Applied(Reduce.HIERARCHICAL, compress, state.islands, cpu=cpu)


def _flat(ddp_model, compress: Optional[str], world_size: int) -> None:
    """One all-reduce per bucket: half precision through a hook, or DDP's own reducer (its bytes counted as
    each backward is armed)."""
    half = COMPRESSIONS[compress]
    if half is not None:
        ddp_model.register_comm_hook(CompressState(WireBuffers(half), world_size), compress_hook)
    else:
        ddp_model.register_forward_pre_hook(CountedAllReduce(ddp_model))
