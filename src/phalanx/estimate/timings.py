"""Timing a model's pieces inside a measuring process: its blocks, the pipelining engine, the gradient passes.

What :func:`~phalanx.estimate.profile.probe` times after a worker's whole steps: each block's forward
and backward per micro-batch (at the batch and at each micro-batch count a pipeline would use,
interleaved), the seconds the pipelining schedule adds per micro-batch, and the passes over the
gradient bytes that DDP, local SGD and a parameter server make. Local work on private copies: no
communication (the engine's one-stage schedule runs in a group of its own rank).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from typing import Callable

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ..comm.own_group import own_group
from ..data import batch as trees

#: timed repeats (after one warm-up) of the per-block timings and the passes over the gradient bytes:
#: memory-bound work on large buffers is noisy where processes share the memory bus, so medians of 9
OP_REPEATS = 9
ENGINE_REPEATS = 5  #: of the one-stage pipeline schedule and the same by hand (a whole step each), at least
MAX_ENGINE_REPEATS = 40
ENGINE_S = 0.5  #: seconds of those pairs per micro-batch count, where ENGINE_REPEATS take less


def now(device: torch.device) -> float:
    """``time.perf_counter()`` once the device's queued work is done (a CUDA kernel returns before it runs)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def time_whole(model, blocks, batch, step: Callable, sizes, device, repeats: int = OP_REPEATS
               ) -> dict[int, list[float]]:
    """Forward+backward seconds of the task's step per micro-batch, at each count in ``sizes`` (interleaved, the
    median of ``repeats`` after one warm-up), shared between the blocks by their parameters: only the whole is
    measured where the blocks cannot be called one by one (a dict batch, a step of the user's)."""
    replica = copy.deepcopy(model).train()
    times: dict[int, list[float]] = {m: [] for m in sizes}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for _ in range(repeats + 1):
            for m in sizes:
                parts = trees.split(batch, m)
                start = now(device)
                for part in parts:
                    step(replica, part).loss.backward()
                times[m].append((now(device) - start) / len(parts))
                replica.zero_grad(set_to_none=True)
    params = [sum(p.numel() for p in block.parameters()) for block in blocks]
    shares = [n / sum(params) for n in params] if sum(params) else [1.0 / len(blocks)] * len(blocks)
    return {m: [statistics.median(done[1:]) * share for share in shares] for m, done in times.items()}


def time_stage_blocks(blocks, x, micro_batches: int, device, repeats: int = OP_REPEATS) -> list[float]:
    """Forward+backward seconds of every block per micro-batch, as a training step runs them.

    ``x`` is cut into ``micro_batches`` micro-batches that run through the blocks one after
    another, their gradients accumulating in the parameters (cleared once per step, as the
    optimizer's ``zero_grad`` does), and the first block's input needs no gradient (it is data).
    That is how a pipeline stage and a whole step run; timing each micro-batch with fresh
    gradients instead (``phalanx.strategies.pipeline.profile``, which only ranks blocks against each other)
    would charge a large layer the first touch of its gradient on every micro-batch. The blocks
    are private copies; the median over ``repeats`` steps after one warm-up is returned.

    Timing a block alone cuts the chain at its ends: its input is detached, and its backward is a
    call of autograd's engine of its own. A stage runs its blocks as one chain (one backward call
    per micro-batch), so the cuts cost what no stage pays (blocks timed one by one sum to more than
    the chain uncut: benchmarks/README.md, "Figures behind the code"). So the same micro-batches also
    run through the chain uncut, and each block keeps its share of that time.
    """
    return time_block_sizes(blocks, x, (micro_batches,), device, repeats)[micro_batches]


def time_block_sizes(blocks, x, sizes, device, repeats: int = OP_REPEATS) -> dict[int, list[float]]:
    """:func:`time_stage_blocks` at several micro-batch counts, interleaved: each repeat times every count in
    turn, so a burst of load from elsewhere falls on all of them alike. The pipeline's cost model takes the
    ratio of these times (the price of cutting the batch), which interleaving keeps steady."""
    import copy

    copies = [copy.deepcopy(block).train() for block in blocks]
    steps: dict[int, list[list[float]]] = {m: [] for m in sizes}
    chain: dict[int, list[float]] = {m: [] for m in sizes}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for _ in range(repeats + 1):
            for m in sizes:
                steps[m].append(_timed_step(copies, x, m, device))
                chain[m].append(_timed_chain(copies, x, m, device))
    out = {}
    for m, done in steps.items():
        each = [statistics.median(step[i] for step in done[1:]) for i in range(len(copies))]
        uncut = statistics.median(chain[m][1:])
        out[m] = [t * uncut / sum(each) for t in each] if sum(each) > 0 else each
    return out


def _timed_step(copies, x, micro_batches: int, device) -> list[float]:
    """One step's forward+backward of every block, per micro-batch (gradients cleared after it)."""
    totals = [0.0] * len(copies)
    for part in x.chunk(micro_batches):
        inputs, outputs, h = [], [], part
        for i, block in enumerate(copies):
            inp = h.detach().requires_grad_(i > 0 and h.is_floating_point())
            start = now(device)
            h = block(inp)
            totals[i] += now(device) - start
            inputs.append(inp)
            outputs.append(h)
        grad = torch.ones_like(h)
        for i in reversed(range(len(copies))):
            start = now(device)
            if outputs[i].requires_grad:
                outputs[i].backward(grad)
            totals[i] += now(device) - start
            grad = inputs[i].grad if inputs[i].grad is not None else torch.zeros_like(inputs[i])
    for block in copies:
        block.zero_grad(set_to_none=True)
    return [t / micro_batches for t in totals]


def _timed_chain(copies, x, micro_batches: int, device) -> float:
    """The same step's forward+backward through the blocks uncut, per micro-batch (gradients cleared after it)."""
    start = now(device)
    for part in x.chunk(micro_batches):
        h = part
        for block in copies:
            h = block(h)
        if h.requires_grad:
            h.backward(torch.ones_like(h))
    seconds = now(device) - start
    for block in copies:
        block.zero_grad(set_to_none=True)
    return seconds / micro_batches


def engine_seconds(ctx, model, x, y, micro_batches, loss_fn) -> dict:
    """Seconds the pipelining schedule adds per micro-batch: a one-stage schedule against the same work by hand
    (micro-batches forward and backward, then the gradients divided by M as ``scale_grads`` does).

    The stage runs in a process group of this rank alone (every rank creates every such group, as
    ``new_group`` requires); a process without a group gets a one-rank group for the measurement.
    """
    import copy

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    with contextlib.nullcontext() if dist.is_initialized() else own_group("gloo", store=dist.HashStore(), rank=0,
                                                                            world_size=1):
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        out = {}
        for m in micro_batches:
            stage_model = copy.deepcopy(model)
            stage = PipelineStage(stage_model, 0, 1, ctx.device, group=groups[dist.get_rank()])
            schedule = ScheduleGPipe(stage, m, loss_fn=loss_fn, scale_grads=True)
            pair = (schedule, stage_model, x, y, m, loss_fn, ctx.device)
            warm = sum(_schedule_and_by_hand(*pair))  # as many pairs as fit in ENGINE_S, at least ENGINE_REPEATS
            repeats = max(ENGINE_REPEATS, min(MAX_ENGINE_REPEATS, int(ENGINE_S / max(warm, 1e-9))))
            added = [engine - by_hand for engine, by_hand in (_schedule_and_by_hand(*pair) for _ in range(repeats))]
            out[m] = max(0.0, statistics.median(added) / m)
        return out


def _schedule_and_by_hand(schedule, stage_model, x, y, m: int, loss_fn, device) -> tuple[float, float]:
    """Seconds of the one-stage schedule's step, then of the same work by hand (its difference is the engine's;
    taken pair by pair, the machine's drift cancels)."""
    t0 = now(device)
    schedule.step(x, target=y, losses=[])
    t1 = now(device)
    stage_model.zero_grad(set_to_none=True)
    for xs, ys in zip(x.chunk(m), y.chunk(m)):
        loss_fn(stage_model(xs), ys).backward()
    for p in stage_model.parameters():  # the schedule's scale_grads, which the model prices apart
        p.grad.div_(m)
    t2 = now(device)
    stage_model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def vector_ops(model, optimizer, batch, device, step: Callable) -> dict:
    """Passes over the gradient bytes: flattening them into a new vector (a ps worker, local SGD) and
    into an existing one (DDP's buckets), copying a vector into the parameters, the server's update
    of one gradient (see strategies/ps), and the first touch of a new buffer of that size."""
    from ..strategies.ps.server import apply_gradients

    params = list(model.parameters())
    step(model, batch).loss.backward()
    size = sum(p.numel() for p in params)
    bucket = torch.zeros(size, device=device)
    pack, copy, unpack, apply = [], [], [], []
    for _ in range(OP_REPEATS + 1):
        vector = parameters_to_vector(params).detach().clone()
        t = now(device)
        torch.cat([p.grad.flatten() for p in params], out=bucket)
        copy.append(now(device) - t)
        t0 = now(device)
        flat = torch.cat([p.grad.flatten() for p in params])
        t1 = now(device)
        vector_to_parameters(vector, params)
        t2 = now(device)
        kept = flat.clone()  # (the update takes the vector it is given)
        t3 = now(device)
        apply_gradients(params, optimizer, [flat], 0.5)  # the server's update, then its reply's copy
        parameters_to_vector(params).detach().contiguous()
        t4 = now(device)
        pack.append(t1 - t0)
        unpack.append(t2 - t1)
        apply.append(t4 - t3)
        for p, g in zip(params, kept.split([p.numel() for p in params])):
            p.grad = g.view_as(p).clone()
    warm = torch.empty(size, device=device)
    fresh = []
    for _ in range(OP_REPEATS + 1):
        t0 = now(device)
        warm.fill_(1.0)
        t1 = now(device)
        torch.empty(size, device=device).fill_(1.0)
        fresh.append(now(device) - t1 - (t1 - t0))
    return {"pack": statistics.median(pack[1:]), "copy": statistics.median(copy[1:]),
            "unpack": statistics.median(unpack[1:]), "apply": statistics.median(apply[1:]),
            "fresh": max(0.0, statistics.median(fresh[1:]))}
