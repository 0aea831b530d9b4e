"""Measuring one worker's step on this machine, under the conditions it would run in.

Who talks to whom: the parent starts K processes through phalanx's own launcher, K being the
worker processes that would share one node (each with the torch threads phalanx would give it:
its share of the cores). Every process runs what a worker of ``phalanx train`` runs per step,
on the same data path (the sharded batches, read ahead by a thread where training's are), the same model and the same
optimizer, with no communication: the task's step (``step(model, batch)``, as train calls it: any batch
tree, the model's own loss or the user's step), backward, clipping and optimizer step, and the rest of the loop
(next batch, learning-rate schedule, the loss as a number). All K run at once, so they compete for
cores and memory as real workers do. After warm-up steps, each phase is timed per step; then the
model's blocks are timed one by one (at the batch and at each micro-batch size a pipeline would
use, interleaved, and the pipelining schedule's own overhead per micro-batch), and the passes over
the gradient bytes that DDP, local SGD and a parameter server make (and the server's update of one
gradient); last, what a step costs beyond its compute and its bytes (``overhead.py``: the model's DDP
step over its bare step, its parameters' all-reduce right after a real step, a parameter server's
round trip).
Every process sends its timings to rank 0, which returns them; :func:`summarise` takes means (the
per-block timings and byte passes: medians of their repeats).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from typing import Any, Callable, Optional

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ..data import batch as trees  # (``batches`` names the sharded batches in probe)
from ..launcher import launch
from ..strategies.pipeline.split import blocks_or_whole
from ..costs import Compute
from ..task.step import DefaultStep
from .overhead import FIGURES, fixed_costs

WARMUP_STEPS = 5
TIMED_S = 1.0  #: seconds of timed steps a measurement takes at least (where --measure-steps take less)
MAX_TIMED_STEPS = 200
#: timed repeats (after one warm-up) of the per-block timings and the passes over the gradient bytes:
#: memory-bound work on large buffers is noisy where processes share the memory bus, so medians of 9
OP_REPEATS = 9
ENGINE_REPEATS = 5  #: of the one-stage pipeline schedule and the same by hand (a whole step each), at least
MAX_ENGINE_REPEATS = 40
ENGINE_S = 0.5  #: seconds of those pairs per micro-batch count, where ENGINE_REPEATS take less


@dataclasses.dataclass(frozen=True)
class ProbeSpec:
    """What every measuring process builds and times (picklable: it travels to the processes)."""

    config: Any  #: the resolved TrainConfig: model, data, batch, optimizer
    steps: int  #: timed steps (after WARMUP_STEPS)
    micro_batches: tuple[int, ...] = ()  #: M values whose per-block micro-batch times a pipeline needs
    task: Any = None  #: the user's problem where the API gave objects (None: the config's names make it)
    #: seconds of timed steps at least (more steps than ``steps`` where they take less); 0: ``steps`` exactly,
    #: for a probe whose compute is not used
    seconds: float = TIMED_S
    bucket_mb: float = 25.0  #: the DDP bucket cap of the measured DDP step (the run's, as the sizes' buckets)


@dataclasses.dataclass(frozen=True)
class Conditions:
    processes: int  #: worker processes computing at once on the node
    threads: int  #: torch threads each
    device: str  #: "cpu" or "cuda:0"
    #: processes beside the workers on the node (a parameter server): idle while the workers' steps are
    #: timed, as a server mostly waits; serving in the round trip (``overhead.py``)
    beside: int = 0


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def probe(ctx, spec: ProbeSpec, beside: int = 0) -> list[dict]:
    """Inside a measuring process: time the steps, the blocks and the server's work; rank 0 returns every rank's.
    Ranks below ``beside`` are the processes beside the workers: they time no step (:func:`_beside`)."""
    import torch.distributed as dist

    if ctx.rank < beside:
        return _beside(ctx, spec, beside)

    from ..data import Prefetcher, ShardedBatches, load_data
    from ..data.loader import prefetch_depth
    from ..comm.wire import metering
    from ..data.user import cast_to_model
    from ..task import task_from

    cfg, device = spec.config, ctx.device
    task = spec.task or task_from(cfg)  # import paths resolve here too: spawned processes copy the parent's sys.path
    data = task.data or load_data(cfg.data, cfg.data_dir, tuple(cfg.synthetic_shape), cfg.synthetic_size, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = task.make_model(data.input_shape, data.num_classes).to(device)
    data = cast_to_model(data, model)
    workers = ctx.world_size - beside
    shards = workers if cfg.batch_size * workers <= len(data.train) else 1
    batches = ShardedBatches(data.train, cfg.batch_size, (ctx.rank - beside) % shards, shards, cfg.seed)
    prefetcher = Prefetcher(batches(0), device, prefetch_depth(cfg.prefetch, device))
    optimizer = task.optimizer_for(cfg, model)
    # the user's scheduler where the task has one (its step is the loop's); else a constant one, as cheap as phalanx's
    schedule = task.scheduler(optimizer, MAX_TIMED_STEPS + WARMUP_STEPS) if task.make_scheduler is not None \
        else torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    step, clip = task.step, cfg.clip_grad_norm

    def one_step() -> tuple[float, ...]:  # forward, backward, optimizer, the rest of the loop; CPU-seconds
        cpu0, t0 = time.process_time(), _now(device)
        batch = next(prefetcher)
        t1 = _now(device)
        loss = step(model, batch).loss  # the task's step: the model called as train calls it, its own loss
        t2 = _now(device)
        loss.backward()
        t3 = _now(device)
        _clip(model, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t4 = _now(device)
        schedule.step()
        float(loss.detach())
        t5 = _now(device)
        return t2 - t1, t3 - t2, t4 - t3, (t1 - t0) + (t5 - t4), time.process_time() - cpu0

    if ctx.distributed:
        dist.barrier()  # start together: the processes compete as workers do
    try:
        warm = [sum(one_step()[:4]) for _ in range(WARMUP_STEPS)]
        rows = [one_step() for _ in range(_timed_steps(ctx, spec, warm))]
        batch = next(prefetcher)
    finally:
        prefetcher.close()
    result = {"rows": rows, **_blocks(model, batch, device, spec, step)}
    if spec.micro_batches:  # a pipeline's rows: the task is a pair the pipeline takes (setup.refuses_task)
        result["engine"] = _engine(ctx, model, *batch, spec.micro_batches, task.loss_fn)
    result.update(_vector_ops(model, optimizer, batch, device, step))

    def ddp_step() -> Callable[[], None]:  # the same step of a DDP copy of the model (every worker makes it at once)
        from torch.nn.parallel import DistributedDataParallel as DDP

        from ..comm.reduce import apply_reduction

        replica = DDP(copy.deepcopy(model), bucket_cap_mb=spec.bucket_mb)
        # as sync builds it: DDP's own reducer, its bytes counted on the wire meter as each backward is armed
        apply_reduction(replica, "flat", None, None, ctx.world_size, ctx.rank, cpu=device.type == "cpu")
        return _step(replica, task.optimizer_for(cfg, replica.module), batch, step, device, clip)

    step_s = statistics.median(sum(row[:4]) for row in rows)
    with metering() as meter:  # every collective and message counted, as in a training step (wire.py)
        meter.begin()
        result.update(fixed_costs(ctx, beside, _step(model, optimizer, batch, step, device, clip), step_s,
                                  ddp_step, lambda: parameters_to_vector(model.parameters())))  # beyond compute and bytes
    if not ctx.distributed:
        return [result]
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, result)
    return every


def _timed_steps(ctx, spec: ProbeSpec, warm: list[float]) -> int:
    """Timed steps every process agrees on: ``spec.steps``, more where they take less than ``spec.seconds`` (a
    measurement of a fraction of a second meets whatever else the machine is doing in it)."""
    import torch.distributed as dist

    slowest = torch.tensor([statistics.median(warm[-3:])], dtype=torch.float64)
    if ctx.distributed:
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return max(spec.steps, min(MAX_TIMED_STEPS, int(spec.seconds / max(slowest.item(), 1e-9))))


def _clip(model, limit: Optional[float]) -> None:
    """``--clip-grad-norm``, as the training step clips (its cost is part of the optimizer's phase)."""
    if limit is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), limit)


def _step(model, optimizer, batch, task_step, device: torch.device, clip: Optional[float] = None
          ) -> Callable[[], None]:
    """One training step of ``model`` on ``batch`` by the task's step, finished on the device."""

    def step() -> None:
        task_step(model, batch).loss.backward()
        _clip(model, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _now(device)

    return step


def _beside(ctx, spec: ProbeSpec, beside: int) -> list[dict]:
    """A process beside the workers (rank 0: a parameter server): it waits while they time their steps,
    joins the collectives they make (the pipelining schedule's groups), serves the round trip."""
    import torch.distributed as dist

    dist.barrier()  # the workers start timing
    _timed_steps(ctx, dataclasses.replace(spec, steps=0, seconds=0.0), [0.0])  # the workers agree on how many
    if spec.micro_batches:  # every rank creates every group the workers' pipelining schedule makes (_engine)
        for r in range(dist.get_world_size()):
            dist.new_group([r])
    result = {"beside": True, **fixed_costs(ctx, beside, lambda: None, 0.0)}
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, result)
    return every


def _blocks(model, batch, device, spec: ProbeSpec, step: Callable) -> dict:
    """Forward+backward seconds per block (at the batch and each micro-batch count a pipeline needs). Blocks are
    timed one by one where a pipeline would run them: a chain of blocks fed a pair's inputs by the convention's
    step. Any other model, batch or step is timed whole, as its step calls it (:func:`time_whole`)."""
    blocks = [block for _, block in blocks_or_whole(model)]
    sizes = (1,) + tuple(spec.micro_batches)
    if len(blocks) > 1 and trees.is_pair(batch) and isinstance(step, DefaultStep):
        timed = time_block_sizes(blocks, batch[0], sizes, device)
    else:
        timed = time_whole(model, blocks, batch, step, sizes, device)
    return {"blocks": timed[1], "micro": {m: timed[m] for m in spec.micro_batches}}


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
                start = _now(device)
                for part in parts:
                    step(replica, part).loss.backward()
                times[m].append((_now(device) - start) / len(parts))
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
            start = _now(device)
            h = block(inp)
            totals[i] += _now(device) - start
            inputs.append(inp)
            outputs.append(h)
        grad = torch.ones_like(h)
        for i in reversed(range(len(copies))):
            start = _now(device)
            if outputs[i].requires_grad:
                outputs[i].backward(grad)
            totals[i] += _now(device) - start
            grad = inputs[i].grad if inputs[i].grad is not None else torch.zeros_like(inputs[i])
    for block in copies:
        block.zero_grad(set_to_none=True)
    return [t / micro_batches for t in totals]


def _timed_chain(copies, x, micro_batches: int, device) -> float:
    """The same step's forward+backward through the blocks uncut, per micro-batch (gradients cleared after it)."""
    start = _now(device)
    for part in x.chunk(micro_batches):
        h = part
        for block in copies:
            h = block(h)
        if h.requires_grad:
            h.backward(torch.ones_like(h))
    seconds = _now(device) - start
    for block in copies:
        block.zero_grad(set_to_none=True)
    return seconds / micro_batches


def _engine(ctx, model, x, y, micro_batches, loss_fn) -> dict:
    """Seconds the pipelining schedule adds per micro-batch: a one-stage schedule against the same work by hand
    (micro-batches forward and backward, then the gradients divided by M as ``scale_grads`` does).

    The stage runs in a process group of this rank alone (every rank creates every such group, as
    ``new_group`` requires); a process without a group gets a one-rank group for the measurement.
    """
    import copy

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
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
    finally:
        if own:
            dist.destroy_process_group()


def _schedule_and_by_hand(schedule, stage_model, x, y, m: int, loss_fn, device) -> tuple[float, float]:
    """Seconds of the one-stage schedule's step, then of the same work by hand (its difference is the engine's;
    taken pair by pair, the machine's drift cancels)."""
    t0 = _now(device)
    schedule.step(x, target=y, losses=[])
    t1 = _now(device)
    stage_model.zero_grad(set_to_none=True)
    for xs, ys in zip(x.chunk(m), y.chunk(m)):
        loss_fn(stage_model(xs), ys).backward()
    for p in stage_model.parameters():  # the schedule's scale_grads, which the model prices apart
        p.grad.div_(m)
    t2 = _now(device)
    stage_model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def _vector_ops(model, optimizer, batch, device, step: Callable) -> dict:
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
        t = _now(device)
        torch.cat([p.grad.flatten() for p in params], out=bucket)
        copy.append(_now(device) - t)
        t0 = _now(device)
        flat = torch.cat([p.grad.flatten() for p in params])
        t1 = _now(device)
        vector_to_parameters(vector, params)
        t2 = _now(device)
        kept = flat.clone()  # (the update takes the vector it is given)
        t3 = _now(device)
        apply_gradients(params, optimizer, [flat], 0.5)  # the server's update, then its reply's copy
        parameters_to_vector(params).detach().contiguous()
        t4 = _now(device)
        pack.append(t1 - t0)
        unpack.append(t2 - t1)
        apply.append(t4 - t3)
        for p, g in zip(params, kept.split([p.numel() for p in params])):
            p.grad = g.view_as(p).clone()
    warm = torch.empty(size, device=device)
    fresh = []
    for _ in range(OP_REPEATS + 1):
        t0 = _now(device)
        warm.fill_(1.0)
        t1 = _now(device)
        torch.empty(size, device=device).fill_(1.0)
        fresh.append(_now(device) - t1 - (t1 - t0))
    return {"pack": statistics.median(pack[1:]), "copy": statistics.median(copy[1:]),
            "unpack": statistics.median(unpack[1:]), "apply": statistics.median(apply[1:]),
            "fresh": max(0.0, statistics.median(fresh[1:]))}


def describe_conditions(conditions: Conditions) -> str:
    """The measurement's conditions in words, as the commands say them while measuring."""
    server = " and a parameter server beside them" if conditions.beside else ""
    return (f"{conditions.processes} worker process(es) at once{server}, {conditions.threads} thread(s) each, on "
            f"{conditions.device}")


def measure(spec: ProbeSpec, conditions: Conditions) -> Compute:
    """Run the probe in ``conditions.processes`` processes at once (and those beside them) and summarise it."""
    device = torch.device(conditions.device)
    devices = [device] * (conditions.processes + conditions.beside)
    threads = conditions.threads if device.type == "cpu" else None
    every = launch(probe, devices, (spec, conditions.beside), threads=threads)
    return summarise(every, conditions)


def summarise(every: list[dict], conditions: Conditions, cores: Optional[int] = None) -> Compute:
    """Means over every process's timed steps, and the pace of lockstep from the slowest process each step, its
    mean over the steps (a run's time is the sum of its steps: a slow step costs it what it costs the mean)."""
    from ..launcher import available_cores

    measured = {k: [r[k] for r in every if r.get(k) is not None] for k in FIGURES}  # the ranks that timed each
    fixed = {k: statistics.median(values) if values else 0.0 for k, values in measured.items()}
    every = [r for r in every if not r.get("beside")]  # they timed no step
    rows = [row for result in every for row in result["rows"]]
    mean = [statistics.fmean(row[k] for row in rows) for k in range(5)]
    spread = statistics.pstdev(sum(row[:4]) for row in rows)
    steps = min(len(result["rows"]) for result in every)
    slowest = statistics.fmean(max(sum(result["rows"][i][:4]) for result in every) for i in range(steps))
    blocks = [statistics.mean(result["blocks"][b] for result in every) for b in range(len(every[0]["blocks"]))]
    micro = {m: tuple(statistics.mean(result["micro"][m][b] for result in every) for b in range(len(blocks)))
             for m in every[0]["micro"]}
    ops = {k: statistics.median(result[k] for result in every) if k in every[0] else 0.0
           for k in ("pack", "copy", "unpack", "apply", "fresh")}
    engine = {m: statistics.median(result["engine"][m] for result in every) for m in every[0].get("engine", {})}
    on_cpu = conditions.device == "cpu"
    return Compute(forward=mean[0], backward=mean[1], optimizer=mean[2], loop=mean[3], slowest=slowest, cpu=mean[4],
                   processes=conditions.processes, threads=conditions.threads,
                   cores=(cores or available_cores()) if on_cpu else None, block_seconds=tuple(blocks),
                   micro_seconds=micro, engine=engine, step_stdev=spread, **ops, **fixed)
