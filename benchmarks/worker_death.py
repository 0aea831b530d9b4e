"""Steps lost when a worker dies: worker 1 SIGKILLs itself as it begins step N of a 2-worker run with
``--checkpoint-every 100``, under sync, local-sgd and diloco, restarted by phalanx (``--max-restarts 1``) and by
torchrun (``torchrun --standalone --nproc-per-node 2 --max-restarts 1``).

    python3 benchmarks/worker_death.py                 # N = 254, 300 steps
    python3 benchmarks/worker_death.py --die-at 150 --save
    python3 benchmarks/worker_death.py --devices cuda  # on a machine with 2 GPUs: NCCL

The death is exact: the model (:class:`DiesAt`, a small MLP on digits) kills its own process with SIGKILL in its
N-th training forward on rank 1 (the start of step N), once per job (a marker file keeps the restarted worker
alive). Every worker then finished step N - 1. The restarted job's header says where it resumed (R);
``steps lost`` is how many finished steps the restart does again, max(0, N - 1 - R). Beside it, what the newest
periodic checkpoint alone would have given (100 * floor((N - 1) / 100): computed, not run, since the restart
before the survivors' save went back to it), and under local-sgd and diloco the dead replica's own local steps
since the last averaging (N - 1 - the last averaging step before N), which die with it whatever is saved.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, save_result  # noqa: E402

HERE = Path(__file__).resolve().parent
STRATEGIES = ("sync", "local-sgd", "diloco")
SYNC_EVERY = 8  # local-sgd's and diloco's default: they average after steps 1, 9, 17, ...


class DiesAt(nn.Module):
    """A small MLP for digits whose rank 1 SIGKILLs its own process at its ``PHALANX_DIE_AT``-th training forward,
    once per job (``PHALANX_DIE_MARK``: a file made just before)."""

    def __init__(self, input_shape=(1, 8, 8), num_classes=10):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, num_classes))
        self.calls = 0

    def forward(self, x):
        import torch.distributed as dist

        self.calls += self.training  # training passes only (phalanx checks the model once in eval mode first)
        mark = Path(os.environ.get("PHALANX_DIE_MARK", "/nonexistent/mark"))
        if self.training and dist.is_initialized() and dist.get_rank() == 1 and \
                self.calls == int(os.environ.get("PHALANX_DIE_AT", "0")) and not mark.exists():
            mark.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)


def last_averaging(step: int) -> int:
    """The last step before ``step`` after which local-sgd and diloco averaged (1, 9, 17, ...)."""
    return max(s for s in range(1, step) if (s - 1) % SYNC_EVERY == 0)


def run(strategy: str, launcher: str, die_at: int, steps: int, devices: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="phalanx-death-") as tmp:
        train = ["train", "--strategy", strategy, "--model", "worker_death:DiesAt", "--steps", str(steps),
                 "--checkpoint-every", "100", "--log-every", "50", "--progress", "lines", "--checkpoint-dir", "ck",
                 "--devices", devices] + (["--workers", "2"] if launcher == "phalanx" else [])
        if launcher == "phalanx":
            cmd = [sys.executable, "-m", "phalanx", *train, "--max-restarts", "1"]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "--max-restarts", "1", "--monitor-interval", "0.5", "-m", "phalanx", *train]
        env = dict(os.environ, PYTHONPATH=str(HERE), PHALANX_DIE_AT=str(die_at),
                   PHALANX_DIE_MARK=str(Path(tmp) / "died"), PYTHONUNBUFFERED="1")
        began = time.perf_counter()
        done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900,
                              stdin=subprocess.DEVNULL)
        seconds = time.perf_counter() - began
    resumed = re.search(r"resuming at step (\d+)", done.stdout)
    saved = re.search(r"^(.* lost; .* saved step \d+.*)$", done.stdout, re.M)
    if done.returncode != 0 or resumed is None:
        raise SystemExit(f"{strategy} under {launcher}: exit {done.returncode}\n{done.stdout[-2000:]}\n"
                         f"{done.stderr[-2000:]}")
    resumed_at = int(resumed.group(1))
    periodic = 100 * ((die_at - 1) // 100)
    row = {"strategy": strategy, "launcher": launcher, "died_at": die_at, "resumed_at": resumed_at,
           "steps_lost": max(0, die_at - 1 - resumed_at), "periodic_only_lost": die_at - 1 - periodic,
           "survivor_line": saved.group(1) if saved else None, "wall_s": round(seconds, 1)}
    if strategy != "sync":
        row["dead_replica_local_steps_lost"] = die_at - 1 - last_averaging(die_at)
    return row


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--die-at", type=int, default=254, help="the step worker 1 dies as it begins")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--launchers", default="phalanx,torchrun")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--devices", default="cpu", help="cpu (gloo), or cuda on a machine with 2 GPUs (NCCL)")
    args = p.parse_args()
    rows = []
    print(f"worker 1 SIGKILLed as it begins step {args.die_at}; 2 workers, --checkpoint-every 100\n")
    print(f"  {'strategy':<10} {'restarted by':<13} {'resumed at':>10} {'steps lost':>10} "
          f"{'(periodic only)':>16} {'dead replica':>13}")
    for launcher in args.launchers.split(","):
        for strategy in args.strategies.split(","):
            row = run(strategy, launcher, args.die_at, args.steps, args.devices)
            rows.append(row)
            replica = row.get("dead_replica_local_steps_lost")
            print(f"  {strategy:<10} {launcher:<13} {row['resumed_at']:>10} {row['steps_lost']:>10} "
                  f"{row['periodic_only_lost']:>16} {'' if replica is None else replica:>13}   ({row['wall_s']} s)")
    save_result("worker_death", args, rows=rows, torch_version=torch.__version__)


if __name__ == "__main__":
    main()
