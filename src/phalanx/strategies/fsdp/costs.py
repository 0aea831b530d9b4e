"""``fsdp``: parameters, gradients and optimizer state sharded over N workers. Pure and analytical.

Each block is one FSDP unit holding 1/N of its parameters. Forward all-gathers a unit's
parameters before it runs (the next unit's all-gather is issued as a unit starts, so it overlaps
that unit's compute) and frees them after; backward all-gathers them again, runs the unit's
backward, and reduce-scatters its gradients so each rank keeps the 1/N it owns; the optimizer
steps 1/N of the parameters. An all-gather or reduce-scatter of S bytes over a ring costs
(N−1)·α + (N−1)/N · S·β. Not validated against a run on this branch (phalanx's FSDP strategy
lands separately): the figures follow from the parameter bytes and the measured compute.
"""

from __future__ import annotations

from ...costs.inputs import Compute, ModelFacts, Network, cpu_bound, gather_or_scatter
from ...costs.model import CostModel
from ...costs.prediction import Prediction
from ..sync.costs import overlaps
from ...costs.timeline import Op, finish, one_stream


def fsdp_ops(compute: Compute, facts: ModelFacts, net: Network, workers: int, pace: float) -> list[Op]:
    shares = compute.block_shares()
    n = len(shares)
    gather = [gather_or_scatter(net, workers, facts.block_bytes(b)) for b in range(n)]
    ops = [Op("gather 0", "comm", gather[0])]
    for b in range(n):  # forward: unit b runs once gathered; unit b+1's gather is issued as b starts
        if b + 1 < n:
            ops.append(Op(f"gather {b + 1}", "comm", gather[b + 1], (f"forward {b - 1}",) if b else ()))
        ops.append(Op(f"forward {b}", "compute", compute.forward * shares[b] * pace,
                      (f"gather {b}",) + ((f"forward {b - 1}",) if b else ())))
    last = f"forward {n - 1}"
    ops.append(Op(f"regather {n - 1}", "comm", gather[n - 1], (last,)))
    for b in reversed(range(n)):  # backward: regather b-1 as b starts; reduce-scatter b once its gradients exist
        if b > 0:
            ops.append(Op(f"regather {b - 1}", "comm", gather[b - 1], (last,)))
        ops.append(Op(f"backward {b}", "compute", compute.backward * shares[b] * pace, (f"regather {b}", last)))
        ops.append(Op(f"reduce-scatter {b}", "comm", gather[b], (f"backward {b}",)))
        last = f"backward {b}"
    scatters = tuple(f"reduce-scatter {b}" for b in range(n))
    ops.append(Op("optimizer", "compute", compute.optimizer / workers * pace, (last,) + scatters))
    ops.append(Op("loop", "compute", compute.loop * pace, ("optimizer",)))  # (losses are all-reduced at log steps)
    return ops


def predict_fsdp(compute: Compute, facts: ModelFacts, net: Network, workers: int) -> Prediction:
    examples = workers * facts.batch_size
    if workers == 1:  # one shard is the whole model: a plain step
        return Prediction("fsdp", 1, 1, compute.step, examples, compute.step, compute.step)
    pace = compute.slowest / compute.step if compute.step > 0 else 1.0
    ops = fsdp_ops(compute, facts, net, workers, pace)
    overlap = overlaps(compute)
    timeline = finish(ops if overlap else one_stream(ops))
    own = compute.forward + compute.backward + compute.optimizer / workers + compute.loop
    comm = sum(op.seconds for op in ops if op.stream == "comm")
    local = min(workers, net.per_node)
    floor = cpu_bound(local * (compute.cpu + comm), compute.cores)
    step = max(timeline, floor)
    notes = [f"{len(compute.block_seconds)} units; 3 collectives per unit per step "
             f"({'overlapped with compute' if overlap else 'not overlapped: the workers fill every core'}); "
             "analytical (no FSDP run on this branch to check it against)"]
    return Prediction("fsdp", workers, net.nodes(workers), step, examples, own * pace, own, notes=tuple(notes),
                      parts={"collectives_total": comm, "timeline": timeline, "cpu_floor": floor})


class FSDPCost(CostModel):
    """Every block a unit sharded over the workers (:func:`predict_fsdp`); analytical."""

    title = "fsdp (analytical)"

    def predict(self, options, compute: Compute, facts: ModelFacts, net: Network, workers: int) -> Prediction:
        return predict_fsdp(compute, facts, net, workers)
