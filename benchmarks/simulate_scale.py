"""How long ``compare --simulate`` takes to answer at scale: the GPT example (examples/gpt.py) at 8, 64 and 256
workers, four strategies, two scenarios (issue 34). It runs the installed command once, as a user would, and
records its wall time, its peak memory, how long each run took to simulate, and the answer.

    python3 benchmarks/simulate_scale.py --save                  # the race (the default)
    python3 benchmarks/simulate_scale.py --no-race --workers 8   # every strategy to the target or --max-steps
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import parser, save_result

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SRC = EXAMPLES.parent / "src"
RUN = re.compile(r"^run (\d+)/(\d+): (.+?) at (\d+) workers, repeat \d+: (.+); simulated in ([\d.]+) s$")


def command(workers: str, strategies: str, scenarios: str, max_steps: str, out: Path, race: bool = True,
            extra: tuple[str, ...] = ()) -> list[str]:
    """The installed command a user runs (``python -m phalanx``: this interpreter's phalanx)."""
    return [sys.executable, "-m", "phalanx", "compare", "--simulate", "--model", "gpt:make", "--data", "gpt:load",
            "--training-step", "gpt:step", "--workers", workers, "--strategies", strategies, "--scenarios", scenarios,
            "--repeats", "1", "--target", "perplexity<=12", "--batch-size", "4", "--max-steps", max_steps,
            "--eval-every", "10", "--link-bandwidth", "10Gb/s", "--link-latency", "20us",
            *([] if race else ["--no-race"]), *extra, "--out", str(out)]


def timed(command: list[str]) -> dict:
    """Run ``command`` from examples/ (its stderr passed through); its wall time, each run's simulated time, the
    report's answer and figures."""
    print(" ".join(command), flush=True)
    began = time.perf_counter()
    proc = subprocess.Popen(command, cwd=EXAMPLES, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(SRC)])})
    runs = []
    for line in proc.stderr:
        sys.stderr.write(line)
        found = RUN.match(line.strip())
        if found:
            runs.append({"run": found[3], "workers": int(found[4]), "outcome": found[5],
                         "simulated_in_s": float(found[6])})
    out = proc.stdout.read()
    proc.wait()
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        sys.exit(f"the command failed ({proc.returncode}):\n{out[-3000:]}")
    report = json.loads((Path(command[-1]) / "report.json").read_text())
    by_count = {n: round(sum(r["simulated_in_s"] for r in runs if r["workers"] == n), 1)
                for n in sorted({r["workers"] for r in runs})}
    return {"command": " ".join(command), "wall_seconds": round(wall, 1), "seconds_by_worker_count": by_count,
            "runs": runs, "answer": report["answer"], "clock": report["clock"], "figures": report["figures"]}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--workers", default="8,64,256")
    p.add_argument("--strategies", default="sync,ps,local-sgd:8,diloco:8")
    p.add_argument("--scenarios", default="none,slow:1:2")
    p.add_argument("--max-steps", default="400")
    p.add_argument("--no-race", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = timed(command(args.workers, args.strategies, args.scenarios, args.max_steps, Path(tmp) / "report",
                               not args.no_race))
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20  # KiB -> GiB
    wall = result["wall_seconds"]
    print(f"\nwall {wall:.0f} s ({wall / 60:.1f} min), peak {peak:.2f} GiB; runs by worker count (s): "
          f"{result['seconds_by_worker_count']}")
    print(" ".join(result["answer"]))
    save_result("simulate_scale" + ("_no_race" if args.no_race else ""), args, peak_rss_gib=round(peak, 2), **result)

if __name__ == "__main__":
    main()
