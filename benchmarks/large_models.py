"""Memory per rank for a Hugging Face Llama of about 100 M parameters (issue 41, item 5): fsdp, fsdp x tensor
parallel 2, fsdp + activation checkpointing and a 2-stage pipeline, on 2 and 4 CPU ranks (gloo), and the peak while
building the model eagerly against on the meta device.

The model is ``transformers.LlamaForCausalLM`` from a config (no download): vocabulary 32,000, width 768, 8 layers,
12 query heads and 4 key/value heads (grouped-query attention), MLP 2,048, untied output layer: 99.5 M parameters,
398 MB in float32. Each variant is one ``phalanx.Trainer(TrainConfig(...), model=factory, ...).fit()``, as a user
runs it, in a fresh process: 3 AdamW steps, 2 sequences of 128 random tokens per data shard and step.

Per rank it reports, from what the run itself records (its metrics file's summary):

- **held**: parameters, gradients and optimizer state (``memory_bytes_max``: the largest rank's; AdamW's two moments
  make the optimizer state twice the parameters);
- **kept for backward**: with ``--activation-checkpointing``, what autograd keeps in one forward of rank 0's batch,
  without and with (``activation_checkpointing.saved_bytes_without`` / ``_with``); phalanx measures it only there;

and, read by the benchmark inside each worker (its model factory and optimizer factory run there), the process's
resident set (``/proc/self/status``):

- **building**: the peak above the resident set just before the factory ran, from the factory to the optimizer's
  creation, i.e. the model built and wrapped (sharded, split or materialised on meta) before the first step;
- **training**: the peak above the same base from the optimizer's creation to the end of the last step (the steps'
  activations, gathered blocks, gradients and AdamW's state; not the final evaluation and checkpoint).

Both resident figures are the largest rank's. Workers run with ``MALLOC_MMAP_THRESHOLD_=1048576`` (as
``sharded.py``: freed tensors go back to the system, so a peak is what was live, not a fragmented heap). Memory
figures, not timing: valid on a loaded machine. One run per variant (no repeats: the bytes held are exact, the
resident peaks vary by a few MB).

    python3 benchmarks/large_models.py --save      # the measurement (2 and 4 ranks, 9 runs)
    python3 benchmarks/large_models.py --tiny      # 2 layers of width 64: end to end in a minute
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, result_path, save_result  # noqa: E402

LLAMA_100M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=128)
LLAMA_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
LENGTH, BATCH, STEPS = 128, 2, 3
#: variant -> (rank counts it runs on, what it changes in the run)
VARIANTS = {
    "fsdp": ((2, 4), {}),
    "fsdp+tp2": ((4,), {"tensor_parallel": 2}),
    "fsdp+ac": ((2, 4), {"activation_checkpointing": True}),
    "pipeline": ((2, 4), {"pipeline": True}),
    "fsdp-meta": ((2, 4), {"init_device": "meta"}),
}


# --------------------------------------------------------------------------- inside a worker

def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _reset_peak() -> None:
    """Linux: the peak resident set (VmHWM) starts again from what the process holds now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _in_worker() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()  # the parent also builds the model (its checks)


_MARKS: dict = {}


def llama(config: dict):
    """The model factory: marks the resident set before building (in a worker), then builds."""
    import transformers

    if _in_worker():
        import torch.distributed.fsdp  # noqa: F401  (what a strategy imports is not the model's building)
        import torch.distributed.pipelining  # noqa: F401
        import torch.distributed.tensor.parallel  # noqa: F401

        transformers.LlamaForCausalLM, transformers.LlamaConfig  # (its lazy import: the modeling module)
        _MARKS.clear()
        _MARKS["base"] = _status("VmRSS")
        _reset_peak()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))


def adamw(folder: str, params):
    """The optimizer factory: called once the model is built and wrapped, so the building's peak ends here; each
    step then writes this rank's peaks to ``folder``."""
    import torch
    import torch.distributed as dist

    optimizer = torch.optim.AdamW(params, lr=1e-4)
    if not _in_worker() or "base" not in _MARKS:
        return optimizer
    _MARKS["build_peak"] = _status("VmHWM")
    _reset_peak()
    rank = dist.get_rank()

    def after_step(*_):
        marks = {**_MARKS, "train_peak": _status("VmHWM"), "rss": _status("VmRSS")}
        Path(folder, f"rank{rank}.json").write_text(json.dumps(marks))
    optimizer.register_step_post_hook(after_step)
    return optimizer


# --------------------------------------------------------------------------- one run (a fresh process)

def token_data(vocab: int, sequences: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sequences, LENGTH), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def one_run(variant: str, ranks: int, tiny: bool) -> dict:
    """Train the variant once; the summary's memory fields and every rank's resident marks."""
    import phalanx
    from phalanx import FSDP, Pipeline

    change = VARIANTS[variant][1]
    config = LLAMA_TINY if tiny else LLAMA_100M
    if change.get("pipeline"):
        strategy = Pipeline(stages=2, chunks=2, balance="params")
    else:
        strategy = FSDP(tensor_parallel=change.get("tensor_parallel", 1), init_device=change.get("init_device"))
    with tempfile.TemporaryDirectory(prefix="phalanx-large-") as folder:
        marks = Path(folder, "marks")
        marks.mkdir()
        cfg = phalanx.TrainConfig(strategy=strategy, devices="cpu", workers=ranks, steps=STEPS, batch_size=BATCH,
                                  progress="none", checkpoint_dir=str(Path(folder, "run")), checkpoint_every=0,
                                  activation_checkpointing=change.get("activation_checkpointing", False))
        phalanx.Trainer(cfg, model=functools.partial(llama, config),
                        train_data=token_data(config["vocab_size"], 16, 0),
                        test_data=token_data(config["vocab_size"], 2, 1),
                        optimizer=functools.partial(adamw, str(marks))).fit()
        summary = next(r for r in map(json.loads, Path(metrics_file(folder)).read_text().splitlines())
                       if r.get("event") == "summary")
        every = [json.loads(p.read_text()) for p in sorted(marks.glob("rank*.json"))]
    if len(every) != ranks:
        raise SystemExit(f"{variant} on {ranks} ranks: {len(every)} ranks wrote their marks, not {ranks}")
    return {"variant": variant, "ranks": ranks, "world_size": summary["world_size"],
            "held": summary.get("memory_bytes_max") or summary["memory_bytes"], "held_rank0": summary["memory_bytes"],
            "activation_checkpointing": summary.get("activation_checkpointing"),
            "build_peak": max(r["build_peak"] - r["base"] for r in every),
            "train_peak": max(r["train_peak"] - r["base"] for r in every),
            "every_rank": every}


def metrics_file(folder: str) -> Path:
    return Path(folder, "run", "metrics.jsonl")


# --------------------------------------------------------------------------- the comparison

def mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"


def table(results: list[dict], parameters: int) -> list[str]:
    lines = [f"Llama {parameters / 1e6:.1f} M parameters ({parameters * 4 / 1e6:.0f} MB float32); MB per rank, the "
             "largest rank's",
             "| variant | ranks | parameters | gradients | optimizer | held | kept for backward (rank 0) | "
             "building peak | training peak |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        held, ac = r["held"], r["activation_checkpointing"]
        kept = f"{mb(ac['saved_bytes_without'])} -> {mb(ac['saved_bytes_with'])}" if ac else ""
        total = held["parameters"] + held["gradients"] + held["optimizer"]
        lines.append(f"| {r['variant']} | {r['ranks']} | {mb(held['parameters'])} | {mb(held['gradients'])} | "
                     f"{mb(held['optimizer'])} | {mb(total)} | {kept} | {mb(r['build_peak'])} | "
                     f"{mb(r['train_peak'])} |")
    return lines


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--tiny", action="store_true", help="2 layers of width 64: a check that it runs end to end")
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--one", nargs=2, metavar=("VARIANT", "RANKS"), help=argparse_suppress())
    args = p.parse_args()
    if args.one:  # a child: one run, its result as the last line
        print("RESULT " + json.dumps(one_run(args.one[0], int(args.one[1]), args.tiny)), flush=True)
        return
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r}: one of {', '.join(VARIANTS)}")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}  # (see the docstring)
    results = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        for variant in wanted:
            if ranks not in VARIANTS[variant][0]:
                continue
            cmd = [sys.executable, __file__, "--one", variant, str(ranks)] + (["--tiny"] if args.tiny else [])
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("RESULT ")), None)
            if done.returncode or line is None:
                raise SystemExit(f"{variant} on {ranks} ranks failed (exit {done.returncode}):\n"
                                 f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
            results.append(json.loads(line[len("RESULT "):]))
            r = results[-1]
            print(f"{variant:<9} {ranks} ranks: held {mb(sum(r['held'].values()))} MB, building peak "
                  f"{mb(r['build_peak'])} MB, training peak {mb(r['train_peak'])} MB", flush=True)
            save(args, results, quiet=True)  # each run as it ends: a partial measurement is kept
    print("\n" + "\n".join(save(args, results)))


def save(args, results: list[dict], quiet: bool = False) -> list[str]:
    config = LLAMA_TINY if args.tiny else LLAMA_100M
    parameters = llama_parameters(config)
    lines = table(results, parameters)
    name = "large_models" + ("-tiny" if args.tiny else "")
    fields = dict(model="transformers.LlamaForCausalLM", config=config, parameters=parameters, steps=STEPS,
                  batch_per_shard=BATCH, length=LENGTH, malloc_mmap_threshold="1048576", results=results, table=lines)
    if quiet:
        result_path(name, args.save).write_text(json.dumps({"benchmark": name, "partial": True, **fields}) + "\n")
    else:
        save_result(name, args, **fields)
    return lines


def llama_parameters(config: dict) -> int:
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in llama(config).parameters())


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
