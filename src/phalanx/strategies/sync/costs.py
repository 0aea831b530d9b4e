"""``sync`` (DDP): gradient buckets all-reduced while the backward pass goes on. Pure.

DDP packs the gradients into buckets in reverse parameter order (the order backward produces
them): the first bucket holds up to 1 MiB, the others up to ``--bucket-mb`` MiB (``facts.buckets``
comes from torch's own assignment function). A bucket is all-reduced as soon as its last gradient
is computed, i.e. when backward reaches the earliest block holding one of its gradients, and the
reductions run one after another on the communication stream while backward continues. The
optimizer waits for the last one. (phalanx's loop all-reduces the losses only at log steps: no
collective of its own per step.) DDP's own machinery (pre-forward work, a hook per gradient, the
reducer's bookkeeping, waking gloo's threads idle after the backward pass) costs a time per step beyond
what its compute and bytes are priced: measured as the model's DDP step over its bare step in the
measuring processes, less this model's own price for that step there (:func:`ddp_fixed`), added once
per step at any worker count.

Where compute and communication share the cores (CPU workers that fill every core), nothing
overlaps. A CPU node also bounds the step from below by the CPU-seconds its processes need.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ...costs.inputs import Compute, ModelFacts, Network, allreduce, allreduce_cpu, at_measuring, cpu_bound
from ...costs.model import Alternative, CostModel
from ...costs.prediction import Prediction
from ...costs.timeline import Op, finish, one_stream

def ddp_fixed(compute: Compute, facts: ModelFacts, net: Network) -> float:
    """DDP's fixed seconds per step: the measured DDP step of the model over its bare step, in the measuring
    processes (``compute.ddp_excess``), less what this model prices itself for that step on their link."""
    ranks = compute.processes
    if compute.ddp_excess <= 0 or ranks < 2:
        return 0.0
    here = at_measuring(compute, net)
    ops = sync_ops(compute, facts, here, ranks, _pace(compute), 0.0)
    priced = finish(ops if overlaps(compute) else one_stream(ops)) - compute.slowest
    return max(0.0, compute.ddp_excess - priced)


def _pace(compute: Compute) -> float:
    """Lockstep's pace: the slowest worker sets it (every compute op is scaled by slowest / step)."""
    return compute.slowest / compute.step if compute.step > 0 else 1.0


def overlaps(compute: Compute, extra_processes: int = 0) -> bool:
    """Whether communication can overlap compute: on GPUs, or on CPU cores not all busy computing."""
    if compute.cores is None:
        return True
    return (compute.processes + extra_processes) * compute.threads < compute.cores


def bucket_ready(compute: Compute, facts: ModelFacts) -> list[float]:
    """The share of backward done when each bucket's last gradient exists (backward runs last block first)."""
    shares = compute.block_shares()
    done_after = [sum(shares[block:]) for block in range(len(shares))]
    return [done_after[first] for _, first in facts.buckets]


def sync_ops(compute: Compute, facts: ModelFacts, net: Network, workers: int, pace: float, fixed: float,
             compress: Optional[str] = None, hierarchical: bool = False) -> list[Op]:
    """The step as ops: forward, backward cut at every bucket's ready point, all-reduces, optimizer, DDP's
    ``fixed`` work (:func:`ddp_fixed`), the loop.

    DDP also passes over every gradient byte three times: copying each gradient into its bucket as
    it is produced, dividing the bucket by N before its all-reduce, and copying the result back into
    the gradients after the last one; each pass costs what copying the gradients into an existing
    vector (``copy``) costs.
    """
    scale = 0.5 if compress else 1.0
    ops = [Op("forward", "compute", compute.forward * pace)]
    done, previous = 0.0, "forward"
    reductions = []
    for k, ((nbytes, _), ready) in enumerate(zip(facts.buckets, bucket_ready(compute, facts))):
        ready = max(ready, done)  # DDP launches bucket k only after buckets 0..k-1
        share = nbytes / max(facts.param_bytes, 1)
        ops.append(Op(f"backward to bucket {k}", "compute",
                      ((ready - done) * compute.backward + share * compute.copy) * pace, (previous,)))
        ops.append(Op(f"divide bucket {k}", "compute", share * compute.copy * pace, (f"backward to bucket {k}",)))
        previous, done = f"divide bucket {k}", ready
        ops.append(Op(f"all-reduce bucket {k}", "comm", allreduce(net, workers, nbytes * scale, hierarchical),
                      (previous,)))
        reductions.append(f"all-reduce bucket {k}")
    ops.append(Op("backward rest", "compute", (1.0 - done) * compute.backward * pace, (previous,)))
    ops.append(Op("copy back", "compute", compute.copy * pace, ("backward rest", *reductions)))
    ops.append(Op("optimizer", "compute", compute.optimizer * pace, ("copy back",)))
    ops.append(Op("DDP's fixed work", "compute", fixed, ("optimizer",)))
    ops.append(Op("loop", "compute", compute.loop * pace, ("DDP's fixed work",)))
    return ops


def predict_sync(compute: Compute, facts: ModelFacts, net: Network, workers: int, compress: Optional[str] = None,
                 hierarchical: bool = False) -> Prediction:
    nodes = net.nodes(workers)
    examples = workers * facts.batch_size
    if workers == 1:  # one process: no DDP, no collective
        return Prediction("sync", 1, 1, compute.step, examples, compute.step, compute.step,
                          parts={"forward": compute.forward, "backward": compute.backward,
                                 "optimizer": compute.optimizer, "loop": compute.loop})
    fixed = ddp_fixed(compute, facts, net)
    ops = sync_ops(compute, facts, net, workers, _pace(compute), fixed, compress, hierarchical)
    overlap = overlaps(compute)
    timeline = finish(ops if overlap else one_stream(ops))
    scale = 0.5 if compress else 1.0
    copied = sum(allreduce_cpu(net, workers, nbytes * scale) for nbytes, _ in facts.buckets)
    local = min(workers, net.per_node)
    work = local * (compute.cpu + copied + 3 * compute.copy)
    floor = cpu_bound(work, compute.cores)
    step = max(timeline, floor)
    comm = sum(op.seconds for op in ops if op.stream == "comm")
    notes = [f"{len(facts.buckets)} bucket(s), all-reduced {'while backward runs' if overlap else 'after backward'}"
             f"{' (the workers fill every core)' if not overlap else ''}"]
    if fixed > 0:
        notes.append(f"DDP's fixed work: {fixed * 1e3:.3g} ms per step (measured: the model's DDP step over its bare "
                     f"step on {compute.processes} processes here, less what this model prices for it)")
    if floor > timeline:
        notes.append(f"CPU-bound: {local} processes need {work * 1e3:.1f} CPU-ms per step on {compute.cores} cores")
    return Prediction("sync", workers, nodes, step, examples, compute.slowest, compute.step, notes=tuple(notes),
                      parts={"compute": compute.slowest, "all_reduce_total": comm, "fixed": fixed,
                             "timeline": timeline, "cpu_floor": floor})


def hierarchical(reduce: str, net: Network, workers: int) -> bool:
    """Whether the gradients take phalanx's hierarchical reduction: asked for, or chosen by ``--reduce auto``
    where the workers span machines with several on each."""
    return reduce == "hierarchical" or (reduce == "auto" and net.nodes(workers) > 1 and net.per_node > 1)


class SyncCost(CostModel):
    """DDP's step (:func:`predict_sync`); its reduction, compression and bucket size change the cost."""

    title = "sync (DDP)"
    fields = ("reduce", "compress", "bucket_mb")

    def plans(self, options, workers: int, blocks: int, per_node: int) -> list:
        """``--reduce hierarchical`` with no ``--islands``: the machines are the islands (the layout asks for
        them spelled out on CPU workers, and this model reduces within each machine first)."""
        if options.reduce != "hierarchical" or options.islands is not None:
            return [options]
        machines = tuple(tuple(range(s, min(s + per_node, workers))) for s in range(0, workers, per_node))
        return [dataclasses.replace(options, islands=machines)]

    def predict(self, options, compute: Compute, facts: ModelFacts, net: Network, workers: int) -> Prediction:
        return predict_sync(compute, facts, net, workers, options.compress, hierarchical(options.reduce, net, workers))

    def alternatives(self, options, compute: Compute, net: Network, workers: int) -> list[Alternative]:
        out = []
        if options.compress is None:
            out.append(Alternative("--compress bf16 (half the bytes on the wire)", {"compress": "bf16"}))
        if net.nodes(workers) > 1 and net.per_node > 1 and options.reduce == "flat":
            out.append(Alternative("--reduce hierarchical (within each machine first, then one leader per machine)",
                                   {"reduce": "hierarchical"}))
        return out

    def bucket_mb(self, options) -> float:
        return options.bucket_mb
