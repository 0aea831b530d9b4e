"""``pipeline``: P stages, M micro-batches per step, fill and drain; optionally R replicas of each stage. Pure.

Stage s spends t_s per micro-batch: forward + backward of its blocks, measured at the micro-batch
size (the blocks are split by phalanx's own exact partition of those times, as ``--balance auto``
does), plus the pipelining engine's own work per micro-batch (measured on a one-stage schedule).
A fill-drain schedule (GPipe; 1F1B has the same bubble) takes Σ t_s + (M−1)·max t_s: the first
micro-batch crosses every stage, the rest follow at the slowest stage's pace. Each stage boundary
adds a message of the activations (forward) and one of their gradients (backward) per
micro-batch: on the first micro-batch's path twice per boundary, and, where a CPU copies the
bytes, on every micro-batch of the stages at the boundary. Then every stage divides its gradients
by M and steps its optimizer on its own parameters, the last stage broadcasts the loss, and with
R > 1 replicas each stage's gradients are all-reduced among its replicas. With equal stages the
idle share is the textbook
(P−1)/(M+P−1) (``phalanx.pipeline.balance``).
"""

from __future__ import annotations

from ..pipeline.balance import partition, predicted_bubble, stage_costs
from .inputs import Compute, ModelFacts, Network, allreduce, cpu_bound
from .prediction import Prediction


def stage_plan(micro_seconds: list[float], stages: int) -> tuple[tuple[int, ...], list[float]]:
    """Blocks per stage (phalanx's exact partition by time) and each stage's seconds per micro-batch."""
    counts = partition(micro_seconds, stages)
    return counts, stage_costs(micro_seconds, counts)


def predict_pipeline(compute: Compute, facts: ModelFacts, net: Network, workers: int, stages: int,
                     micro_batches: int) -> Prediction:
    replicas = workers // stages
    seconds = list(compute.micro_seconds[micro_batches])
    counts, per_stage = stage_plan(seconds, stages)
    if stages > 1:  # the engine's own work per micro-batch, on every stage
        per_stage = [t + compute.engine.get(micro_batches, 0.0) for t in per_stage]
    total = sum(per_stage)
    slowest = max(per_stage)
    micro = facts.batch_size // micro_batches
    cuts = [sum(counts[:s + 1]) - 1 for s in range(stages - 1)]  # the last block of every stage but the last
    cut_bytes = [facts.activation_bytes[b] * micro for b in cuts]
    links = [net.intra if (s // net.per_node) == ((s + 1) // net.per_node) else net.inter for s in range(stages - 1)]
    hops = [link.message(n) for link, n in zip(links, cut_bytes)]
    # Per micro-batch, a stage moves one message each way over each of its boundaries, on its own CPU
    # where the CPU is the transport.
    copying = [0.0] * stages
    if compute.cores is not None:
        for s, (link, n) in enumerate(zip(links, cut_bytes)):
            for stage in (s, s + 1):
                copying[stage] += 2 * link.cpu(1, n)
    steady = max(t + c for t, c in zip(per_stage, copying))
    schedule = total + 2 * sum(hops) + (micro_batches - 1) * steady
    params = _stage_params(facts, counts)
    # Each stage steps the optimizer on its parameters; the engine first divides its gradients by M (a pass).
    optimizer = (compute.optimizer + (compute.copy if stages > 1 else 0.0)) * max(params) / max(sum(params), 1)
    loss = allreduce(net, stages, 4)
    sync = allreduce(_replica_net(net, stages), replicas, max(params) * facts.bytes_per_param)
    timeline = schedule + optimizer + compute.loop + loss + sync
    busy = [micro_batches * t + micro_batches * c for t, c in zip(per_stage, copying)]
    local = min(workers, net.per_node)
    floor = cpu_bound(sum(busy[:local]) * compute.cpu / max(compute.step, 1e-12) + local * compute.loop,
                      compute.cores) if compute.cores is not None else 0.0
    step = max(timeline, floor)
    work = micro_batches * total / stages
    bubble = (total + (micro_batches - 1) * slowest) - work
    ideal = work + compute.optimizer / stages + compute.loop
    notes = [f"{stages} stages x {micro_batches} micro-batches, blocks {'+'.join(map(str, counts))}; "
             f"bubble {predicted_bubble(per_stage, micro_batches):.1%} (equal stages: "
             f"{(stages - 1) / (micro_batches + stages - 1):.1%})"]
    if replicas > 1:
        notes.append(f"{replicas} replicas of every stage: gradients all-reduced among them after each step")
    return Prediction("pipeline", workers, net.nodes(workers), step, replicas * facts.batch_size,
                      work + optimizer + compute.loop, min(ideal, step), bubble=max(0.0, bubble),
                      notes=tuple(notes),
                      parts={"stage_seconds_per_micro_batch": per_stage, "boundary_messages": hops,
                             "schedule": schedule, "optimizer": optimizer, "loss_broadcast": loss,
                             "replica_all_reduce": sync, "timeline": timeline, "cpu_floor": floor})


def _stage_params(facts: ModelFacts, counts: tuple[int, ...]) -> list[int]:
    out, start = [], 0
    for c in counts:
        out.append(sum(facts.block_params[start:start + c]))
        start += c
    return out


def _replica_net(net: Network, stages: int) -> Network:
    """The replicas of one stage sit ``stages`` ranks apart: per node, per_node / stages of them."""
    return Network(net.intra, net.inter, max(1, net.per_node // stages))
