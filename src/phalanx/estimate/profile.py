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
gradient): ``timings.py``; last, what a step costs beyond its compute and its bytes (``overhead.py``: the model's DDP
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
from torch.nn.utils import parameters_to_vector

from ..data import batch as trees  # (``batches`` names the sharded batches in probe)
from ..launcher import launch
from ..strategies.pipeline.split import blocks_or_whole
from ..costs import Compute
from ..task.step import calls_model_alone
from .overhead import FIGURES, fixed_costs
from .timings import engine_seconds, now, time_block_sizes, time_whole, vector_ops

WARMUP_STEPS = 5
TIMED_S = 1.0  #: seconds of timed steps a measurement takes at least (where --measure-steps take less)
MAX_TIMED_STEPS = 200


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
        cpu0, t0 = time.process_time(), now(device)
        batch = next(prefetcher)
        t1 = now(device)
        loss = step(model, batch).loss  # the task's step: the model called as train calls it, its own loss
        t2 = now(device)
        loss.backward()
        t3 = now(device)
        _clip(model, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t4 = now(device)
        schedule.step()
        float(loss.detach())
        t5 = now(device)
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
        x, y = batch
        result["engine"] = engine_seconds(ctx, model, x, y, spec.micro_batches, task.loss_fn)
    result.update(vector_ops(model, optimizer, batch, device, step))

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
        # beyond compute and bytes
        result.update(fixed_costs(ctx, beside, _step(model, optimizer, batch, step, device, clip), step_s,
                                  ddp_step, lambda: parameters_to_vector(model.parameters())))
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
        now(device)

    return step


def _beside(ctx, spec: ProbeSpec, beside: int) -> list[dict]:
    """A process beside the workers (rank 0: a parameter server): it waits while they time their steps,
    joins the collectives they make (the pipelining schedule's groups), serves the round trip."""
    import torch.distributed as dist

    dist.barrier()  # the workers start timing
    _timed_steps(ctx, dataclasses.replace(spec, steps=0, seconds=0.0), [0.0])  # the workers agree on how many
    if spec.micro_batches:  # every rank creates every group the workers' pipelining schedule makes (engine_seconds)
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
    if len(blocks) > 1 and trees.is_pair(batch) and calls_model_alone(step, model):
        timed = time_block_sizes(blocks, batch[0], sizes, device)
    else:
        timed = time_whole(model, blocks, batch, step, sizes, device)
    return {"blocks": timed[1], "micro": {m: timed[m] for m in spec.micro_batches}}


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
