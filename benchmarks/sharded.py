"""sync against fsdp on the same model, side by side: what sharding costs in throughput, what it saves.

Two models: the built-in cifar10 network (1.07 M parameters) and a wide MLP (7 blocks, hidden
2048: 24.6 M parameters, 98 MB of float32 weights, no block more than 17 MB, so that the one
block fsdp gathers at a time is small beside the whole), both on synthetic 3x24x24 images. Variants:
``sync`` (DDP), ``fsdp`` (torch's fully_shard, parameters freed after each block's forward) and
``fsdp-keep`` (``--no-reshard-after-forward``: gathered once per step). Each run is a fresh job of
2 workers through phalanx's own runtimes (``runtime_for``), a fixed random batch per rank, the
first steps a warm-up left out of the timing. Variants are interleaved within every repeat (load
drift hits all alike); medians with their spread and the ratios fsdp / sync are printed and saved
with the machine and versions under benchmarks/results/.

Per rank it reports two memory figures:

- **held**: bytes of parameters + gradients + optimizer state the rank holds (``phalanx.memory``,
  the figure phalanx prints in every run's summary); goal for fsdp on W workers: about 1/W of
  sync's (0.5 here);
- **peak**: what the process really reached while training: ``torch.cuda.max_memory_allocated``
  on a GPU (every tensor: activations, DDP's buckets, fsdp's gathered blocks); on the CPU the
  process's peak resident set from just before the first step (VmHWM, reset through
  /proc/self/clear_refs), which also counts the interpreter, torch and the model as built
  (a few hundred MB that neither variant can save), so compare its differences, not its ratio.
  CPU workers run with ``MALLOC_MMAP_THRESHOLD_=1048576``: fsdp allocates and frees a gathered
  block per block and step, and glibc's default (a threshold that grows with what was freed)
  then keeps that memory in a fragmented heap, so the resident set creeps up to about twice
  what is live (measured: 0.96 GB resident, 0.45 GB after malloc_trim, for the wide MLP).

Devices: ``--devices cpu`` (gloo, 1 torch thread per worker by default), ``cuda`` (NCCL, one GPU
per worker: it needs 2 GPUs, since NCCL cannot put two ranks on one device), ``auto`` (cuda where
2 GPUs exist, else cpu).

    python3 benchmarks/sharded.py                                   # 5 repeats, both models
    python3 benchmarks/sharded.py --repeats 1 --steps 2 --warmup 1 --batch 8 --models cifar10   # smoke test

``--checkpoint``: what a checkpoint costs each rank, instead of the throughput table. fsdp on 2 and
on 3 CPU workers trains examples/gpt.py's GPT at a larger size (``--gpt-layers``, ``--gpt-width``:
8 x 768 by default, 57 M parameters) with AdamW, then saves one checkpoint three ways, interleaved
within every repeat: ``full`` (what fsdp did before: the whole model and optimizer state gathered to
rank 0, ``get_state_dict`` with full state dicts, written as one file), ``sharded`` (torch's
distributed checkpoint, each rank its own shard: ``checkpoint/dcp.py``) and ``async`` (the same in the
background, ``--async-checkpoint``). Per rank: the peak resident set in training and while saving
(VmHWM reset before each), against the model's bytes over W and its state's (parameters + AdamW's
two moments) over W; and the seconds the save held the step up.

    python3 benchmarks/sharded.py --checkpoint --repeats 2          # about 4 minutes on 2 cores

``--checkpoint-strategy pipeline`` measures the same for a pipeline of as many stages as workers (the GPT
traced and split between its blocks): ``full`` is ``PipelineRuntime.state_dict()`` (every stage's part
gathered to rank 0, one file: what the trainer saved before), ``sharded`` each stage its own part.

    python3 benchmarks/sharded.py --checkpoint --checkpoint-strategy pipeline --checkpoint-workers 2 \
        --checkpoint-variants full,sharded --repeats 2 --save

``--init-memory`` measures instead what building costs (issue 32): the GPT example (examples/gpt.py) at 99 M
parameters, fsdp on 2 and 3 CPU ranks, built eagerly (every rank builds the whole model, then shards it) and on
the meta device (``--init-device meta``: one block materialised at a time); per rank the peak resident set above
the process before building (VmHWM reset at the worker's start), over building + sharding and over one AdamW step,
beside the model's bytes over W:

    python3 benchmarks/sharded.py --init-memory --repeats 2 --save
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from phalanx import FSDP, Pipeline, Sync
from phalanx.launcher import launch
from phalanx.memory import Held, held, size
from phalanx.task.models import cifar10
from phalanx.strategies import runtime_for

from _common import parser, save_result, spread

SHAPE = (3, 24, 24)
WORKERS = 2


def wide_mlp(hidden: int = 2048, depth: int = 5) -> nn.Sequential:
    """Flatten + Linear(1728, hidden), ``depth`` blocks Linear(hidden, hidden), a head: one block each."""
    blocks = [nn.Sequential(nn.Flatten(), nn.Linear(math.prod(SHAPE), hidden), nn.ReLU())]
    blocks += [nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(hidden, 10))


MODELS = {"cifar10": lambda: cifar10(SHAPE, 10), "wide-mlp": wide_mlp}
VARIANTS = {"sync": Sync(), "fsdp": FSDP(), "fsdp-keep": FSDP(reshard_after_forward=False)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(ctx, variant: str, model_name: str, batch: int, warmup: int, steps: int, lr: float) -> list:
    """One timed run on this rank; rank 0 returns every rank's (seconds, held bytes, peak bytes)."""
    torch.manual_seed(0)  # the same initial weights on every rank (fsdp checks it)
    model = MODELS[model_name]().to(ctx.device)
    runtime = runtime_for(VARIANTS[variant], ctx, model, lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
                          F.cross_entropy)
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(batch, *SHAPE, generator=g).to(ctx.device)
    y = torch.randint(0, 10, (batch,), generator=g).to(ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    else:
        _reset_peak_rss()
    start = time.perf_counter()
    for step in range(warmup + steps):
        if step == warmup:
            _sync(ctx.device)
            dist.barrier()
            start = time.perf_counter()
        runtime.train_step(x, y)
    _sync(ctx.device)
    dist.barrier()  # every rank's steps are in the time
    seconds = time.perf_counter() - start
    if ctx.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(ctx.device)
    else:
        peak = _peak_rss()
    mine = (seconds, held(runtime.module, runtime.optimizer), peak)
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    return every


def _reset_peak_rss() -> None:
    """Linux: start the process's peak resident set (VmHWM) again from what it holds now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the peak counts from the process's start (see _peak_rss)


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


def devices_for(choice: str) -> list[torch.device]:
    gpus = torch.cuda.device_count()
    if choice == "auto":
        choice = "cuda" if gpus >= WORKERS else "cpu"
    if choice == "cuda":
        if gpus < WORKERS:
            raise SystemExit(f"--devices cuda needs {WORKERS} GPUs (one per worker: NCCL cannot put two ranks on one "
                             f"device) but {gpus} found; use --devices cpu")
        return [torch.device("cuda", i) for i in range(WORKERS)]
    return [torch.device("cpu")] * WORKERS


def one_run(variant: str, model: str, devices: list, args) -> dict:
    threads = args.threads if devices[0].type == "cpu" else None
    ranks = launch(worker, devices, (variant, model, args.batch, args.warmup, args.steps, args.lr), threads=threads)
    slowest = max(seconds for seconds, _, _ in ranks)
    return {"examples_per_sec": args.batch * len(devices) * args.steps / slowest,
            "held": max((h for _, h, _ in ranks), key=lambda h: h.total), "peak": max(p for _, _, p in ranks)}


def report(model: str, runs: dict, devices: list) -> dict:
    """Print one model's table and ratios; return what is saved."""
    params = sum(p.numel() for p in MODELS[model]().parameters())
    where = f"{devices[0].type} ({'nccl' if devices[0].type == 'cuda' else 'gloo'})"
    peak_kind = "peak allocated" if devices[0].type == "cuda" else "peak RSS in training"
    print(f"\n{model} ({params / 1e6:.2f} M parameters), {WORKERS} workers on {where}: median (min-max) over repeats")
    print(f"  {'variant':<10} {'examples/sec':>24}   held per rank: params + grads + optimizer = total   {peak_kind}")
    out = {}
    for variant, results in runs.items():
        rates = [r["examples_per_sec"] for r in results]
        h: Held = results[-1]["held"]  # held bytes do not vary between repeats
        peak = statistics.median(r["peak"] for r in results)
        lo, hi = spread(rates)
        print(f"  {variant:<10} {statistics.median(rates):9.1f} ({lo:7.1f}-{hi:7.1f})   {size(h.parameters)} + "
              f"{size(h.gradients)} + {size(h.optimizer)} = {size(h.total)}   {size(int(peak))}")
        out[variant] = {"examples_per_sec": rates, "median_examples_per_sec": statistics.median(rates),
                        "held_bytes": h.as_dict(), "held_total": h.total, "median_peak_bytes": peak}
    sync = out["sync"]
    for variant in [v for v in out if v != "sync"]:
        mine = out[variant]
        paired = [f["examples_per_sec"] / s["examples_per_sec"] for f, s in zip(runs[variant], runs["sync"])]
        mine["throughput_ratio"] = mine["median_examples_per_sec"] / sync["median_examples_per_sec"]
        mine["paired_throughput_ratios"] = paired
        mine["held_ratio"] = mine["held_total"] / sync["held_total"]
        mine["peak_saved_bytes"] = sync["median_peak_bytes"] - mine["median_peak_bytes"]
        print(f"  {variant} / sync: throughput {mine['throughput_ratio']:.3f} (paired {statistics.median(paired):.3f}, "
              f"{min(paired):.3f}-{max(paired):.3f}); held memory per rank {mine['held_ratio']:.3f} (goal about "
              f"1/{WORKERS} = {1 / WORKERS:.2f}); {peak_kind} {size(int(mine['median_peak_bytes']))} vs "
              f"{size(int(sync['median_peak_bytes']))} (saves {size(max(0, int(mine['peak_saved_bytes'])))})")
    return out


# --------------------------------------------------------------------------- --checkpoint: what a save costs

CHECKPOINT_VARIANTS = ("full", "sharded", "async")
CHECKPOINT_WORKERS = (2, 3)


def gpt_model(layers: int, width: int) -> nn.Module:
    """examples/gpt.py's GPT, scaled up: ``layers`` blocks of width ``width`` (12 heads of width / 12)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import gpt

    return gpt.GPT(gpt.GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=12, n_embd=width))


def checkpoint_worker(ctx, variant: str, root: str, layers: int, width: int, steps: int,
                      strategy: str = "fsdp") -> list:
    """``steps`` fsdp (or pipeline) steps, then a checkpoint the ``variant`` way, twice; every rank's (train peak,
    the second save's peak, resident before it, seconds it blocked)."""
    import gpt
    from phalanx import checkpoint as ckpt
    from phalanx.checkpoint import ShardWriter

    torch.manual_seed(0)
    model = gpt_model(layers, width)
    g = torch.Generator().manual_seed(ctx.rank)
    batch = (torch.randint(0, 256, (2, 64), generator=g), torch.randint(0, 256, (2, 64), generator=g))
    options = FSDP() if strategy == "fsdp" else Pipeline(chunks=2, balance="params")
    runtime = runtime_for(options, ctx, model, lambda p: torch.optim.AdamW(p, lr=1e-4), example=batch,
                          training_step=gpt.step)
    writer = ShardWriter(ctx, asynchronous=variant == "async") if variant != "full" else None
    _reset_peak_rss()
    train_peak = 0
    # Two rounds of steps and a save; the second save is the one measured (the first makes the background
    # writer's gloo group and DCP's plans: once per run).
    for save in (1, 2):
        for _ in range(steps):
            runtime.train_step(batch)
        dist.barrier()
        train_peak, before = max(train_peak, _peak_rss()), _rss()
        _reset_peak_rss()
        began = time.perf_counter()
        small = {"format": ckpt.FORMAT, "step": save, "run_id": "benchmark", "meta": {"parameter_shapes": {}}}
        if writer is None:  # the whole state gathered to rank 0 (fsdp: cpu_offload), one file
            state = runtime.state_dict()
            if ctx.rank == 0:
                ckpt.save_checkpoint({**small, **state}, root, save, keep=1)
            del state
        else:
            writer.save(runtime.shard_state_dict(), small, root, save, keep=1)
        blocked = time.perf_counter() - began
        if writer is not None:
            writer.wait()  # (the background write's memory is in the save's peak too)
        dist.barrier()
        saved_peak = _peak_rss()
        _reset_peak_rss()
    mine = (train_peak, saved_peak, before, blocked)
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    return every


# --------------------------------------------------------------------------- a model built on meta (--init-memory)

#: the GPT example at about 100 M parameters (14 blocks of 7.1 M, 28 MB each in float32); bytes, not quality
GPT_100M = dict(vocab_size=256, block_size=64, n_layer=14, n_head=12, n_embd=768)
INIT_VARIANTS = {"fsdp": False, "fsdp-meta": True}  # variant -> built on the meta device


def gpt_100m():
    import gpt  # examples/gpt.py (put on the path by init_memory)

    return gpt.GPT(gpt.GPTConfig(**GPT_100M))


def init_worker(ctx, meta: bool, steps: int) -> list:
    """Every rank's (resident set before building, peak over building + sharding, peak over ``steps`` AdamW steps
    on one 64-token window, parameter bytes held), all in bytes, the peaks above the first figure."""
    import gpt
    from phalanx.strategies import meta_init

    _reset_peak_rss()
    base = _rss()
    torch.manual_seed(0)
    with meta_init.building(meta):
        model = gpt_100m()
    options = FSDP(init_device="meta", init_weights=gpt.init_weights) if meta else FSDP()
    runtime = runtime_for(options, ctx, model, lambda params: torch.optim.AdamW(params, lr=1e-4),
                          training_step=gpt.step)
    dist.barrier()
    built = _peak_rss() - base
    g = torch.Generator().manual_seed(ctx.rank)
    window = torch.randint(0, 256, (1, 64), generator=g)
    for _ in range(steps):
        runtime.train_step((window, window))
    trained = _peak_rss() - base
    mine = (base, built, trained, held(runtime.module, runtime.optimizer).parameters)
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    return every


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def checkpoint_run(variant: str, workers: int, args) -> dict:
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="phalanx-ckpt-bench-")
    try:
        ranks = launch(checkpoint_worker, [torch.device("cpu")] * workers,
                       (variant, root, args.gpt_layers, args.gpt_width, args.steps, args.checkpoint_strategy),
                       threads=args.threads)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"train_peak": [r[0] for r in ranks], "save_peak": [r[1] for r in ranks],
            "before_save": [r[2] for r in ranks], "blocked_s": max(r[3] for r in ranks)}


def checkpoint_report(runs: dict, model_bytes: int, params: int, args) -> dict:
    """Per worker count and variant: medians over repeats of each rank's peaks, against the bytes over W."""
    state_bytes = 3 * model_bytes  # parameters + AdamW's exp_avg and exp_avg_sq
    print(f"\nGPT {params / 1e6:.1f} M parameters: model {size(model_bytes)}, with AdamW's state {size(state_bytes)}; "
          "medians over repeats, per rank (rank 0 first)")
    out: dict = {}
    for workers, variants in runs.items():
        print(f"  {args.checkpoint_strategy} on {workers} workers: model / W = {size(model_bytes // workers)}, "
              f"state / W = {size(state_bytes // workers)}")
        out[workers] = {"model_bytes_over_w": model_bytes // workers, "state_bytes_over_w": state_bytes // workers}
        for variant, results in variants.items():
            per_rank = {key: [statistics.median(r[key][rank] for r in results) for rank in range(workers)]
                        for key in ("train_peak", "save_peak", "before_save")}
            added = [peak - before for peak, before in zip(per_rank["save_peak"], per_rank["before_save"])]
            blocked = [r["blocked_s"] for r in results]
            out[workers][variant] = {**per_rank, "save_added": added, "blocked_s": blocked,
                                     "median_blocked_s": statistics.median(blocked),
                                     "save_added_max_over_state_per_w": max(added) / (state_bytes / workers)}
            print(f"    {variant:<8} peak in training {' / '.join(size(int(v)) for v in per_rank['train_peak'])}; "
                  f"while saving {' / '.join(size(int(v)) for v in per_rank['save_peak'])} (the save adds "
                  f"{' / '.join(size(int(max(0, v))) for v in added)}: at most "
                  f"{out[workers][variant]['save_added_max_over_state_per_w']:.2f} x state / W); blocked "
                  f"{statistics.median(blocked):.2f} s ({min(blocked):.2f}-{max(blocked):.2f})")
    return out


def checkpoint_main(args) -> None:
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")  # freed tensors go back to the system (docstring)
    model = gpt_model(args.gpt_layers, args.gpt_width)
    params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    variants = [v for v in args.checkpoint_variants.split(",") if v]
    counts = [int(w) for w in args.checkpoint_workers.split(",") if w]
    runs = {w: {v: [] for v in variants} for w in counts}
    for r in range(args.repeats):
        for workers in counts:
            for variant in variants:
                result = checkpoint_run(variant, workers, args)
                runs[workers][variant].append(result)
                print(f"repeat {r + 1}/{args.repeats}  {args.checkpoint_strategy} x{workers} {variant:<8} save "
                      "peak "
                      f"{' / '.join(size(v) for v in result['save_peak'])}  blocked {result['blocked_s']:.2f} s",
                      flush=True)
    saved = checkpoint_report(runs, model_bytes, params, args)
    name = "sharded-checkpoint" + ("" if args.checkpoint_strategy == "fsdp" else f"-{args.checkpoint_strategy}")
    save_result(name, args, workers=counts, strategy=args.checkpoint_strategy, parameters=params,
                model_bytes=model_bytes, results=saved, malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                goal="a sharded save adds about (state / W) or less to each rank's resident set, where the full "
                     "gather adds the whole state to rank 0's")


def init_memory(args) -> None:
    """Peak resident memory per rank while the GPT builds and trains, fsdp on 2 and 3 ranks, eager and on meta,
    beside the model's bytes over W; interleaved repeats, medians (of the largest rank's figure)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")  # (see the module's docstring)
    model_bytes = sum(p.numel() * p.element_size() for p in gpt_100m().parameters())
    counts = [int(w) for w in args.init_workers.split(",")]
    runs = {(w, v): [] for w in counts for v in INIT_VARIANTS}
    for r in range(args.repeats):
        for w in counts:
            for variant, meta in INIT_VARIANTS.items():
                ranks = launch(init_worker, [torch.device("cpu")] * w, (meta, args.init_steps), threads=args.threads)
                runs[(w, variant)].append(ranks)
                print(f"repeat {r + 1}/{args.repeats}  {w} ranks {variant:<9} build peak "
                      f"{size(max(b for _, b, _, _ in ranks))}, training peak {size(max(t for _, _, t, _ in ranks))}",
                      flush=True)
    saved = init_report(runs, model_bytes)
    save_result("sharded-init", args, model=f"examples/gpt.py {GPT_100M}", model_bytes=model_bytes,
                steps=args.init_steps, threads=args.threads, results=saved,
                malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                goal="built on meta, a rank's peak while building is about the model's bytes / W plus one block, "
                     "not the whole model")


def init_report(runs: dict, model_bytes: int) -> dict:
    print(f"\nGPT example, {model_bytes / 4e6:.1f} M parameters ({size(model_bytes)} float32), one block "
          f"{size(model_bytes // GPT_100M['n_layer'])}: peak resident memory per rank above the process before "
          "building (largest rank, median over repeats; the last column: the peak over building and one AdamW step)")
    print(f"  {'ranks':>5} {'variant':<10} {'model/W':>10} {'build peak':>11} {'/ (model/W)':>12} "
          f"{'build + 1 step':>14} {'params held':>12}")
    out = {}
    for (w, variant), repeats in runs.items():
        built = statistics.median(max(b for _, b, _, _ in ranks) for ranks in repeats)
        trained = statistics.median(max(t for _, _, t, _ in ranks) for ranks in repeats)
        params = max(p for _, _, _, p in repeats[-1])
        print(f"  {w:>5} {variant:<10} {size(model_bytes // w):>10} {size(int(built)):>11} "
              f"{built / (model_bytes / w):>12.2f} {size(int(trained)):>14} {size(params):>12}")
        out[f"{w}-{variant}"] = {"ranks": w, "variant": variant, "model_bytes_over_w": model_bytes / w,
                                 "median_build_peak_bytes": built, "median_training_peak_bytes": trained,
                                 "build_peak_over_model_over_w": built / (model_bytes / w),
                                 "parameter_bytes_held": params,
                                 "every_rank": [[list(r) for r in ranks] for ranks in repeats]}
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=64, help="images per worker per step")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="timed steps per run")
    p.add_argument("--threads", type=int, default=1, help="torch threads per CPU worker")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--devices", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)} "
                                                                  "(sync is always run: the ratios are against it)")
    p.add_argument("--checkpoint", action="store_true", help="measure a checkpoint's memory instead (see above)")
    p.add_argument("--checkpoint-variants", default=",".join(CHECKPOINT_VARIANTS))
    p.add_argument("--checkpoint-strategy", choices=("fsdp", "pipeline"), default="fsdp")
    p.add_argument("--checkpoint-workers", default=",".join(map(str, CHECKPOINT_WORKERS)))
    p.add_argument("--gpt-layers", type=int, default=8)
    p.add_argument("--gpt-width", type=int, default=768)
    p.add_argument("--init-memory", action="store_true", help="instead: peak memory per rank building the GPT "
                                                                   "example at 100 M parameters, eager and on meta")
    p.add_argument("--init-workers", default="2,3", help="with --init-memory: the rank counts")
    p.add_argument("--init-steps", type=int, default=1, help="with --init-memory: AdamW steps after building")
    args = p.parse_args()
    if args.init_memory:
        return init_memory(args)
    if args.checkpoint:
        if "--steps" not in os.sys.argv:
            args.steps = 1  # memory, not time: one step makes every buffer (AdamW's state included)
        return checkpoint_main(args)
    models = [m for m in args.models.split(",") if m]
    variants = ["sync"] + [v for v in args.variants.split(",") if v and v != "sync"]
    unknown = [m for m in models if m not in MODELS] + [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown model or variant: {', '.join(unknown)}")
    devices = devices_for(args.devices)
    if devices[0].type == "cpu":  # read by the spawned workers' C library at start (see the docstring)
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")

    runs = {m: {v: [] for v in variants} for m in models}
    for r in range(args.repeats):
        for model in models:
            for variant in variants:
                result = one_run(variant, model, devices, args)
                runs[model][variant].append(result)
                print(f"repeat {r + 1}/{args.repeats}  {model:<8} {variant:<9} {result['examples_per_sec']:9.1f} "
                      f"examples/sec  held {size(result['held'].total)}  peak {size(result['peak'])}", flush=True)

    saved = {model: report(model, runs[model], devices) for model in models}
    save_result("sharded", args, devices=[str(d) for d in devices], workers=WORKERS, results=saved,
                malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                goal="fsdp holds about 1/W of sync's parameters + gradients + optimizer state per rank; on CPU it "
                     "costs throughput (the figure to report), on GPUs (NCCL) the cost should be small")


if __name__ == "__main__":
    main()
