"""``pipeline``: P stages, M micro-batches per step, fill and drain; optionally R replicas of each stage. Pure.

Stage s spends t_s per micro-batch: forward + backward of its blocks, measured at the micro-batch
size and put on the scale of the measured step (:func:`micro_block_seconds`; the blocks are split by
phalanx's own exact partition of those times, as ``--balance auto`` does), plus the pipelining
engine's own work per micro-batch (measured on a one-stage schedule).
A fill-drain schedule (GPipe; 1F1B has the same bubble) takes Σ t_s + (M−1)·max t_s: the first
micro-batch crosses every stage, the rest follow at the slowest stage's pace. Each stage boundary
adds a message of the activations (forward) and one of their gradients (backward) per
micro-batch: on the first micro-batch's path twice per boundary, and, where a CPU copies the
bytes, on every micro-batch of the stages at the boundary. Then every stage divides its gradients
by M and steps its optimizer on its own parameters, the last stage broadcasts the loss, and with
R > 1 replicas each stage's gradients are all-reduced among its replicas. With equal stages the
idle share is the textbook
(P−1)/(M+P−1) (``phalanx.strategies.balance``).
"""

from __future__ import annotations

import dataclasses

from ...errors import PhalanxError
from ..balance import check_stages, partition, predicted_bubble, stage_costs
from ...costs.inputs import Compute, ModelFacts, Network, allreduce, cpu_bound
from ...costs.model import Alternative, CostModel
from ...costs.prediction import Prediction


def stage_plan(micro_seconds: list[float], stages: int) -> tuple[tuple[int, ...], list[float]]:
    """Blocks per stage (phalanx's exact partition by time) and each stage's seconds per micro-batch."""
    counts = partition(micro_seconds, stages)
    return counts, stage_costs(micro_seconds, counts)


def micro_block_seconds(compute: Compute, micro_batches: int) -> list[float]:
    """Every block's forward+backward seconds per micro-batch, on the scale of the measured step.

    The blocks are timed one by one and the step in the training loop: two measurements of the same
    work, taken apart, and they disagree (on a busy machine by more than either figure's spread; and
    the loop also runs the loss and beside the prefetch thread). Taken as they were, a 1-worker
    pipeline came out faster than the very step it runs (benchmarks/README.md, "Figures behind the
    code"). So the block times give only the shares and the price of cutting the batch: the blocks at
    the whole batch are scaled to sum to the measured forward + backward, the micro-batch times by the
    same factor, and a block on 1/M of the batch never costs less than 1/M of it on the whole batch (M
    micro-batches do the same arithmetic in smaller pieces). One stage on M micro-batches is then never faster than
    the step of one worker.
    """
    micro, whole = compute.micro_seconds[micro_batches], compute.block_seconds
    measured = sum(whole)
    if len(whole) != len(micro) or measured <= 0:  # nothing to put them on a scale with
        return list(micro)
    scale = (compute.forward + compute.backward) / measured
    return [max(m, w / micro_batches) * scale for m, w in zip(micro, whole)]


def predict_pipeline(compute: Compute, facts: ModelFacts, net: Network, workers: int, stages: int,
                     micro_batches: int) -> Prediction:
    replicas = workers // stages
    seconds = micro_block_seconds(compute, micro_batches)
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
    # Per micro-batch, a stage moves one message each way over each of its boundaries, copying its
    # bytes on its own CPU where the CPU is the transport. Not its α: the engine's sends and receives
    # are posted asynchronously and gloo's threads carry them, so a stage pays α only where it waits
    # for a message (the first micro-batch's path, above): a compute loop that also sends to a waiting
    # peer slows by a fraction of the fitted α (the figures: benchmarks/README.md, "Figures behind the code").
    copying = [0.0] * stages
    if compute.cores is not None:
        for s, (link, n) in enumerate(zip(links, cut_bytes)):
            for stage in (s, s + 1):
                copying[stage] += 2 * n * link.copy_seconds_per_byte()
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
        notes.append(f"{replicas} replicas of every stage (--stages {stages} on {workers} workers): gradients "
                     "all-reduced among them after each step")
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


class PipelineCost(CostModel):
    """P stages x R replicas, M micro-batches (:func:`predict_pipeline`)."""

    title = "pipeline"
    fields = ("stages", "chunks", "schedule", "split_points")  # (split points: refused in one line, see plans)
    bubble = True
    #: its compute is measured per micro-batch at this batch: twice the batch would need measuring again
    scales_with_batch = False

    def plans(self, options, workers: int, blocks: int, per_node: int) -> list:
        """``--stages`` as given; otherwise every stage count that divides the workers, from the most (one
        stage per worker) down, none above one per block: 8 workers on 5 blocks make 4 stages x 2 replicas.

        A model split by tracing (``--split-points``, or one with no blocks of its own) is refused in one
        line: the prices are per block, measured by running the blocks one after another."""
        if getattr(options, "split_points", ()):
            raise PhalanxError(f"--split-points {','.join(options.split_points)}: estimate prices a pipeline by the "
                               "model's blocks (an nn.Sequential or pipeline_blocks()), and a model split by tracing "
                               "is not priced yet; leave --split-points out, or run phalanx compare (real runs)")
        if blocks == 1 and (options.stages or 1) > 1:
            raise PhalanxError(f"--stages {options.stages}: estimate prices a pipeline by the model's blocks (an "
                               "nn.Sequential or pipeline_blocks()), and this model has none of its own (training "
                               "splits it by tracing, which estimate does not price yet); run phalanx compare (real "
                               "runs)")
        if options.stages is not None:
            check_stages(blocks, options.stages)  # (the layout's own check) no worker count could run it
            return [options]
        counts = [s for s in range(min(workers, blocks), 0, -1) if workers % s == 0]
        return [dataclasses.replace(options, stages=s) for s in counts
                if options.schedule != "1f1b" or options.chunks >= s]

    def predict(self, options, compute: Compute, facts: ModelFacts, net: Network, workers: int) -> Prediction:
        return predict_pipeline(compute, facts, net, workers, options.stages or workers, options.chunks)

    def micro_batches(self, options, batch_size: int) -> tuple[int, ...]:
        """M, and 2M where the batch splits into it (the advice tries twice the micro-batches)."""
        m = options.chunks
        return (m, 2 * m) if batch_size % (2 * m) == 0 else (m,)

    def alternatives(self, options, compute: Compute, net: Network, workers: int) -> list[Alternative]:
        m = 2 * options.chunks
        if m not in compute.micro_seconds:  # measured only where the batch splits into 2M
            return []
        return [Alternative(f"--chunks {m} (more micro-batches: a smaller bubble)", {"chunks": m})]
