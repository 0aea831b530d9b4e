"""DiLoCo against sync: the accuracy it keeps, the bytes it saves, and what that buys on a slow link.

(a) Digits, the default CNN, 2 CPU workers: ``sync`` and ``diloco --sync-every 20`` train the same
    number of steps (``phalanx train``, as a user would); final test accuracy and bytes on the wire
    per step (the summary's: what every rank sent, priced by the collectives' algorithms). DiLoCo
    runs with the paper's outer lr 0.7 and Nesterov momentum 0.9 (phalanx's defaults until issue 30;
    the default momentum is 0 now) and with outer momentum 0.5, and
    both strategies also with the usual DiLoCo inner optimizer (AdamW, lr 1e-3). Goal: within 0.01
    of sync's accuracy, at most 1/20 of its bytes per step (+5%).
(b) A real 50 Mbit/s link (``phalanx compare --scenarios link:50mbit``): a model of 1.13M parameters
    (:func:`wide_mlp`, below, named by import path as a user's own model is) on digits, time to
    target accuracy for ``sync`` and ``diloco:20``. Goal: diloco's median at most 1/3 of sync's. (Its recorded
    result ran diloco:20 with the then default outer momentum 0.9; it runs with today's default, 0.)

Every variant runs once per repeat, interleaved (seeds 0, 1, 2 ...); medians and min-max.

    python3 benchmarks/diloco_link.py [--repeats 3 --steps 600 --target 0.9] [--save]

(b) needs root (network namespaces and traffic control); without them it is skipped, saying why.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from torch import nn

from phalanx.comm.shaped_link import LinkUnavailable, parse_rate, probe

from _common import RESULTS, parser, result_path, save_result

HERE = Path(__file__).resolve().parent
#: (a)'s variants: name -> the flags of ``phalanx train``
TRAIN_VARIANTS = {
    "sync": ["--strategy", "sync"],
    "diloco:20": ["--strategy", "diloco", "--sync-every", "20", "--outer-momentum", "0.9"],  # as recorded
    "diloco:20 outer momentum 0.5": ["--strategy", "diloco", "--sync-every", "20", "--outer-momentum", "0.5"],
    "sync adamw": ["--strategy", "sync", "--optimizer", "adamw", "--lr", "0.001"],
    "diloco:20 adamw": ["--strategy", "diloco", "--sync-every", "20", "--outer-momentum", "0.9", "--optimizer",
                        "adamw", "--lr", "0.001"],
}
#: (a)'s comparisons: diloco variant -> the sync it is judged against (same inner optimizer)
PAIRS = {"diloco:20": "sync", "diloco:20 outer momentum 0.5": "sync", "diloco:20 adamw": "sync adamw"}


def wide_mlp(input_shape, num_classes) -> nn.Module:
    """64 -> 1024 -> 1024 -> 10 on digits: 1.13M parameters, 4.5 MB of gradient a step."""
    inputs = 1
    for s in input_shape:
        inputs *= s
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, num_classes))


def phalanx(*args: str, cwd: Path, diverging: bool = False) -> subprocess.CompletedProcess:
    """``python3 -m phalanx ARGS``, with this folder importable (the workers import wide_mlp from it).
    ``diverging``: a run the NaN guard stopped is a result, not a failure of the benchmark."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "phalanx", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0 and not (diverging and "model diverged" in done.stderr):
        raise SystemExit(f"phalanx {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done


def train(flags: list[str], steps: int, seed: int) -> dict:
    """Final accuracy and bytes per step of one run; a run that diverged counts as accuracy 0."""
    with tempfile.TemporaryDirectory() as tmp:
        phalanx("train", "--devices", "cpu", "--workers", "2", "--steps", str(steps), "--seed", str(seed),
                "--progress", "none", "--checkpoint-dir", "ck", *flags, cwd=Path(tmp), diverging=True)
        events = [json.loads(line) for line in (Path(tmp) / "ck" / "metrics.jsonl").read_text().splitlines()]
    summary = next((e for e in reversed(events) if e["event"] == "summary"), None)
    if summary is None:
        step = next(e["step"] for e in reversed(events) if e["event"] == "diverged")
        return {"accuracy": 0.0, "bytes_per_step": None, "diverged_at": step}
    return {"accuracy": summary["test_accuracy"], "bytes_per_step": summary["wire_bytes_per_step"],
            "train_seconds": summary["train_seconds"]}


def part_a(args) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in TRAIN_VARIANTS}
    for seed in range(args.repeats):
        for name, flags in TRAIN_VARIANTS.items():
            out = train(flags, args.steps, seed)
            runs[name].append(out)
            said = f"diverged at step {out['diverged_at']}" if "diverged_at" in out else \
                f"accuracy {out['accuracy']:.4f}  {out['bytes_per_step'] / 1e3:9.1f} kB/step"
            print(f"(a) seed {seed} {name:<30} {said}", flush=True)
    medians = {name: {"accuracy": statistics.median(r["accuracy"] for r in rs),
                      "bytes_per_step": statistics.median([r["bytes_per_step"] for r in rs
                                                           if r["bytes_per_step"] is not None] or [math.nan]),
                      "diverged": sum("diverged_at" in r for r in rs)}
               for name, rs in runs.items()}
    verdicts = {}
    print(f"\n(a) {args.steps} steps, 2 workers, digits, cnn; medians of {args.repeats} (min-max)")
    for name, rs in runs.items():
        acc = [r["accuracy"] for r in rs]
        diverged = f", {medians[name]['diverged']} diverged (counted as 0)" if medians[name]["diverged"] else ""
        print(f"  {name:<30} accuracy {medians[name]['accuracy']:.4f} ({min(acc):.4f}-{max(acc):.4f}{diverged})  "
              f"{medians[name]['bytes_per_step'] / 1e3:9.1f} kB/step")
    for diloco, sync in PAIRS.items():
        gap = medians[sync]["accuracy"] - medians[diloco]["accuracy"]
        ratio = medians[diloco]["bytes_per_step"] / medians[sync]["bytes_per_step"]
        met = gap <= 0.01 and ratio <= 1.05 / 20
        verdicts[diloco] = {"against": sync, "accuracy_gap": gap, "bytes_ratio": ratio, "goal_met": met}
        print(f"  {diloco} vs {sync}: accuracy {-gap:+.4f}, bytes per step x{ratio:.4f} (1/{1 / ratio:.1f}); "
              f"goal (gap <= 0.01, ratio <= {1.05 / 20:.4f}) {'met' if met else 'NOT met'}")
    return {"steps": args.steps, "runs": runs, "medians": medians, "verdicts": verdicts}


def part_b(args) -> dict | None:
    try:
        probe(parse_rate(args.rate))
    except LinkUnavailable as e:
        print(f"\n(b) skipped: {e}")
        return None
    out = (RESULTS if args.save else Path(tempfile.gettempdir()) / "phalanx-benchmarks") / \
        result_path("diloco_link-compare", args.save).stem
    done = phalanx("compare", "--strategies", "sync,diloco:20", "--scenarios", f"link:{args.rate}",
                   "--model", "diloco_link:wide_mlp", "--workers", "2", "--devices", "cpu", "--target",
                   str(args.target), "--max-steps", str(args.max_steps), "--eval-every", str(args.eval_every),
                   "--repeats", str(args.repeats), "--out", os.path.relpath(out, HERE), cwd=HERE)
    print("\n(b) " + done.stdout[done.stdout.rfind(f"link:{args.rate} ("):].strip())
    report = json.loads((out / "report.json").read_text())
    rows = {f["strategy"]: f for f in report["figures"][f"link:{args.rate}"]}
    sync, diloco = rows["sync"], rows["diloco:20"]
    ratio = diloco["median_seconds"] / sync["median_seconds"] if sync["median_seconds"] and \
        diloco["median_seconds"] else None
    print(f"\n(b) time to {args.target} on link:{args.rate}: diloco:20 / sync = "
          f"{'not reached' if ratio is None else f'{ratio:.3f}'}; goal (<= 1/3) "
          f"{'met' if ratio is not None and ratio <= 1 / 3 else 'NOT met'}")
    return {"report": str(out.relative_to(HERE.parent)) if args.save else str(out), "rate": args.rate,
            "target": args.target, "figures": rows, "time_ratio": ratio,
            "goal_met": ratio is not None and ratio <= 1 / 3}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=600, help="(a): steps of every run")
    p.add_argument("--rate", default="50mbit", help="(b): the shaped link's rate")
    p.add_argument("--target", type=float, default=0.9, help="(b): the target test accuracy")
    p.add_argument("--max-steps", type=int, default=150, help="(b): a run stops here if it has not reached it")
    p.add_argument("--eval-every", type=int, default=10, help="(b): evaluations (time to target's resolution)")
    p.add_argument("--skip-a", action="store_true", help="run (b) only")
    args = p.parse_args()
    a = None if args.skip_a else part_a(args)
    b = part_b(args)
    save_result("diloco_link", args, accuracy_and_bytes=a, slow_link=b)


if __name__ == "__main__":
    main()
