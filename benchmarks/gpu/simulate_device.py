"""``compare --simulate`` on a GPU against the CPU: the GPT example (examples/gpt.py), the command of
``benchmarks/simulate_scale.py`` with ``--devices cuda`` and then ``--devices cpu``.

Both legs get the same clock (``--step-time 10ms`` and the link given), so they simulate the same schedule and
differ only in where the workers' gradients, parameters, optimizer states and evaluations are computed: their wall
times compare the same work, and their answers (the winner and its steps to the target) should agree, not bit
for bit (other kernels round otherwise, and a run's curve drifts from there) but to an evaluation or so. First,
the workers' gradients alone on the device (64 workers of 4 windows, as ``benchmarks/simulate_gradients.py``):
vmap (kept on a GPU where attention's backward loops inside it) against one worker after another, and sync's
whole batch, so that the choice ``Gradients.on_cpu`` makes for a GPU is measured.

    python3 benchmarks/gpu/simulate_device.py --quick --save   # 8 and 64 workers, 50 steps: ~3 min on an H200
    python3 benchmarks/gpu/simulate_device.py --save           # 8, 64, 256 workers, 400 steps, on cuda only
    python3 benchmarks/gpu/simulate_device.py --devices cpu --workers 2,4 --max-steps 10 --gradient-rounds 1  # dry run
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples")]

from _common import parser, save_result  # noqa: E402
from simulate_scale import command, timed  # noqa: E402

QUICK = {"workers": "8,64", "strategies": "sync,local-sgd:8", "scenarios": "none", "max_steps": "50"}
FULL = {"workers": "8,64,256", "strategies": "sync,ps,local-sgd:8,diloco:8", "scenarios": "none,slow:1:2",
        "max_steps": "400"}


def gradients(device: torch.device, workers: int, rounds: int) -> dict:
    """Milliseconds (median of ``rounds`` after a warm-up) of 64 workers' gradients on ``device``: each on its own
    parameters by vmap and in turn, and sync's whole batch; and how far vmap's are from in turn's."""
    import gpt
    from phalanx.simulate.gradients import Gradients
    from phalanx.task.step import UserStep

    torch.manual_seed(0)
    model = gpt.make(105).to(device)
    (x, y), _ = gpt.load()
    B = 4
    shards = [(x[i * B:(i + 1) * B].to(device), y[i * B:(i + 1) * B].to(device)) for i in range(workers)]
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    rows = torch.stack([flat + 1e-3 * w for w in range(workers)])
    whole = (torch.cat([b[0] for b in shards]), torch.cat([b[1] for b in shards]))
    vmapped, in_turn, sync = (Gradients(model, None, UserStep(gpt.step)) for _ in range(3))
    vmapped.on_cpu(False)  # vmap kept even where an op loops inside it
    in_turn.vmappable = False
    calls = {"vmap": lambda: vmapped.each(rows, shards), "in turn": lambda: in_turn.each(rows, shards),
             "sync whole": lambda: sync.mean(flat, shards, whole)}
    times: dict[str, list[float]] = {name: [] for name in calls}
    out = {}
    for r in range(rounds + 1):
        for name, call in calls.items():
            _wait(device)
            began = time.perf_counter()
            out[name] = call()
            _wait(device)
            if r:
                times[name].append((time.perf_counter() - began) * 1e3)
    med = {name: round(statistics.median(v), 2) for name, v in times.items()}
    gap = float((out["vmap"][0] - out["in turn"][0]).abs().max())
    print(f"  {device}: {workers} workers' gradients, ms (median of {rounds}): {med}; vmap - in turn, max |diff| "
          f"{gap:.2e}", flush=True)
    return {"ms": med, "ms_all": times, "vmap_minus_in_turn_max_abs": gap}


def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true", help="8 and 64 workers, sync and local-sgd:8, 50 steps")
    p.add_argument("--devices", default=None, help="the legs, in order (default: cuda,cpu with --quick, else cuda)")
    p.add_argument("--rounds", type=int, default=1, help="each leg this many times, interleaved")
    p.add_argument("--gradient-rounds", type=int, default=5)
    for name in ("workers", "strategies", "scenarios", "max-steps"):
        p.add_argument(f"--{name}", default=None, help="instead of the shape's (--quick or full)")
    args = p.parse_args()
    shape = {k: getattr(args, k) or v for k, v in (QUICK if args.quick else FULL).items()}
    devices = (args.devices or ("cuda,cpu" if args.quick else "cuda")).split(",")
    grads = {d: gradients(torch.device(d), 64, args.gradient_rounds) for d in devices}
    legs: dict[str, list[dict]] = {d: [] for d in devices}
    for _ in range(args.rounds):
        for d in devices:
            with tempfile.TemporaryDirectory() as tmp:
                legs[d].append(timed(command(shape["workers"], shape["strategies"], shape["scenarios"],
                                             shape["max_steps"], Path(tmp) / "report",
                                             extra=("--devices", d, "--strict-devices", "--step-time", "10ms"))))
    print()
    for d, runs in legs.items():
        walls = [r["wall_seconds"] for r in runs]
        print(f"{d}: wall {statistics.median(walls):.1f} s (runs {walls}); by worker count (s): "
              f"{runs[-1]['seconds_by_worker_count']}")
        print("  " + " ".join(runs[-1]["answer"]))
    if len(devices) > 1:
        first, *others = devices
        for d in others:
            ratio = statistics.median(r["wall_seconds"] for r in legs[d]) / statistics.median(
                r["wall_seconds"] for r in legs[first])
            same = legs[d][-1]['answer'] == legs[first][-1]['answer']
            print(f"{d} / {first} wall: {ratio:.2f}x; same answer: {same}")
    save_result("simulate_device" + ("-quick" if args.quick else ""), args, shape=shape, gradients=grads, legs=legs)


if __name__ == "__main__":
    main()
