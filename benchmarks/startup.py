"""Where a run's seconds go before it trains: a cold `phalanx train --steps 1` against `import torch`,
and a small comparison started cold (every worker a fresh interpreter) and warm (forks of the fork
server, the default).

    python3 benchmarks/startup.py                 # 5 interleaved rounds, then the comparison twice
    python3 benchmarks/startup.py --rounds 9 --save

Part 1, interleaved per round (so that a change in the machine's load hits every variant alike):
``python3 -c "import torch"``; ``phalanx train --steps 1 --progress none`` as it is; the same with
``PHALANX_START_METHOD=spawn`` (each worker imports torch itself, as before the fork server).
Medians, min-max, and the ratios to ``import torch`` (issue 20's goal: train ≤ 2.2 × import torch).

Part 2: ``phalanx compare`` (2 strategies × 2 scenarios × 2 repeats) warm and cold, interleaved:
wall time, median start-up per run and the share of wall time spent training and evaluating, from
the comparison's own report.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_medians, save_result  # noqa: E402

TRAIN = [sys.executable, "-m", "phalanx", "train", "--steps", "1", "--progress", "none", "--overwrite",
         "--checkpoint-dir", "ck"]
COMPARE = [sys.executable, "-m", "phalanx", "compare", "--strategies", "sync,ps", "--scenarios", "none,slow:1:2",
           "--repeats", "2", "--target", "0.9", "--max-steps", "120", "--out", "report"]
VARIANTS = {
    "import torch": ([sys.executable, "-c", "import torch"], {}),
    "phalanx train (fork server)": (TRAIN, {}),
    "phalanx train (spawn)": (TRAIN, {"PHALANX_START_METHOD": "spawn"}),
}


def timed(cmd: list[str], env: dict, cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env={**os.environ, **env}, check=True, stdout=subprocess.DEVNULL,
                   stdin=subprocess.DEVNULL)
    return time.perf_counter() - start


def cold_start(rounds: int, scratch: Path) -> dict:
    print(f"1. cold start, {rounds} interleaved rounds (seconds of wall time)")
    runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
    timed(TRAIN, {}, scratch)  # once untimed: the digits cache and the file system's caches are warm for all
    for _ in range(rounds):
        for name, (cmd, env) in VARIANTS.items():
            runs[name].append(timed(cmd, env, scratch))
    med = print_medians(runs, 30, " s")
    ratios = {name: med[name] / med["import torch"] for name in VARIANTS}
    for name, r in ratios.items():
        print(f"  {name:<30} {r:5.2f} x import torch")
    return {"seconds": runs, "medians": med, "ratios_to_import_torch": ratios}


def comparison(scratch: Path, repeats: int) -> dict:
    print(f"\n2. phalanx compare (sync, ps x none, slow:1:2 x 2 repeats), warm and cold, {repeats} times each")
    out: dict[str, list[dict]] = {"warm (fork server)": [], "cold (spawn)": []}
    for _ in range(repeats):
        for name, env in (("warm (fork server)", {}), ("cold (spawn)", {"PHALANX_START_METHOD": "spawn"})):
            where = Path(tempfile.mkdtemp(dir=scratch))
            wall = timed(COMPARE, env, where)
            runs = json.loads((where / "report" / "report.json").read_text())["runs"]
            busy = sum(r["train_seconds"] + r["eval_seconds"] for r in runs)
            out[name].append({"wall_s": wall, "busy_share": busy / wall,
                              "startup_s_median": statistics.median(r["startup_seconds"] for r in runs)})
    for name, rows in out.items():
        wall = statistics.median(r["wall_s"] for r in rows)
        share = statistics.median(r["busy_share"] for r in rows)
        startup = statistics.median(r["startup_s_median"] for r in rows)
        print(f"  {name:<20} wall {wall:6.1f} s, training + evaluation {share:5.1%} of it, "
              f"start-up per run {startup:.2f} s (median)")
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of part 1")
    p.add_argument("--compare-repeats", type=int, default=1, help="times each comparison runs in part 2 (0: skip)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        cold = cold_start(args.rounds, scratch)
        compared = comparison(scratch, args.compare_repeats) if args.compare_repeats else None
    save_result("startup", args, cold_start=cold, compare=compared)


if __name__ == "__main__":
    main()
