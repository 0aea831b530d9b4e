"""Where a run's seconds go before it trains: a cold `phalanx train --steps 1` against `import torch`,
and a small comparison started cold (every worker a fresh interpreter) and warm (forks of the fork
server, the default).

    python3 benchmarks/startup.py                 # 10 interleaved rounds, then the comparison once
    python3 benchmarks/startup.py --rounds 15 --compare-repeats 0 --save
    python3 benchmarks/startup.py --before /tmp/before   # also the package of /tmp/before/src (git archive)
    python3 benchmarks/startup.py --link 50mbit          # also phalanx train on a shaped link (root)
    python3 benchmarks/startup.py --loader-workers 2     # also phalanx train reading a Dataset with loader workers
    python3 benchmarks/startup.py --hugging-face         # also a script fitting a Hugging Face Llama twice

Part 1, interleaved per round (so that a change in the machine's load hits every variant alike):
``python3 -c "import torch"``; one SGD step written by hand in one process (what any training
pays beyond ``import torch``: constructing a ``torch.optim`` optimizer imports ``torch._dynamo``);
``phalanx train --steps 1 --progress none`` as it is (2 workers); the same with
``PHALANX_START_METHOD=spawn`` (each worker imports torch itself, as before the fork server).
Medians, min-max, the ratios of the medians to ``import torch`` (issue 42's goal: train ≤ 1.5 ×
import torch) and the median of each round's own ratio; the load average before and after. As root, each
command's CPU too (all its processes': the fork server's and the workers' included, through a cgroup).

Part 2: ``phalanx compare`` (2 strategies × 2 scenarios × 2 repeats) warm and cold, interleaved:
wall time, median start-up per run and the share of wall time spent training and evaluating, from
the comparison's own report.json.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_medians, save_result  # noqa: E402

TRAIN = [sys.executable, "-m", "phalanx", "train", "--steps", "1", "--progress", "none", "--overwrite",
         "--checkpoint-dir", "ck"]
COMPARE = [sys.executable, "-m", "phalanx", "compare", "--strategies", "sync,ps", "--scenarios", "none,slow:1:2",
           "--repeats", "2", "--target", "0.9", "--max-steps", "120", "--out", "report"]
HAND_WRITTEN_STEP = ("import torch; model = torch.nn.Linear(64, 10); "
                     "optimizer = torch.optim.SGD(model.parameters(), lr=0.1); "
                     "model(torch.randn(32, 64)).sum().backward(); optimizer.step()")
VARIANTS = {
    "import torch": ([sys.executable, "-c", "import torch"], {}),
    "one SGD step by hand": ([sys.executable, "-c", HAND_WRITTEN_STEP], {}),
    "phalanx train (fork server)": (TRAIN, {}),
    "phalanx train (spawn)": (TRAIN, {"PHALANX_START_METHOD": "spawn"}),
}


#: A script as a Hugging Face user writes one: a small Llama from a config, two fits of one step on 2 workers in one
#: process (the second's workers start from the server the first started).
HF_FIT = """
import torch
import transformers

from phalanx import Sync, TrainConfig, Trainer

if __name__ == "__main__":
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=100))
    ids = torch.randint(0, 100, (64, 16))
    for _ in range(2):
        Trainer(TrainConfig(strategy=Sync(), workers=2, devices="cpu", steps=1, batch_size=4, checkpoint_every=0,
                            checkpoint_dir="hf", overwrite=True, progress="none"),
                model=model, train_data={"input_ids": ids, "labels": ids}).fit()
"""


#: A cgroup (v1 cpuacct, root only) that each timed command and every process it starts run in: their CPU,
#: the fork server's and the workers' included (processes the command never waits for).
CPU_GROUP = Path("/sys/fs/cgroup/cpuacct/phalanx-startup")


def timed(cmd: list[str], env: dict, cwd: Path, cpu: Optional[list[float]] = None) -> float:
    """The command's wall time; its CPU, everything it started included, appended to ``cpu`` where measurable."""
    try:
        CPU_GROUP.mkdir(exist_ok=True)
        used = int((CPU_GROUP / "cpuacct.usage").read_text())
    except OSError:
        used = None
    join = (lambda: (CPU_GROUP / "cgroup.procs").write_text(str(os.getpid()))) if used is not None else None
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env={**os.environ, **env}, check=True, stdout=subprocess.DEVNULL,
                   stdin=subprocess.DEVNULL, preexec_fn=join)
    wall = time.perf_counter() - start
    if used is not None and cpu is not None:
        while (CPU_GROUP / "cgroup.procs").read_text().strip():  # (the fork server ends just after the command)
            time.sleep(0.05)
        cpu.append((int((CPU_GROUP / "cpuacct.usage").read_text()) - used) / 1e9)
    return wall


def cold_start(rounds: int, scratch: Path, before: Optional[Path] = None, link: Optional[str] = None,
               loader_workers: int = 0, hugging_face: bool = False) -> dict:
    variants = dict(VARIANTS)
    trains = {"phalanx train": TRAIN}
    if link is not None:
        trains[f"phalanx train --link {link}"] = [*TRAIN, "--link", link]
    if loader_workers:
        shutil.copy(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "points.py", scratch)
        trains[f"phalanx train --loader-workers {loader_workers}"] = [
            *TRAIN, "--model", "mlp", "--data", "points:load", "--loader-workers", str(loader_workers)]
    if hugging_face:
        (scratch / "hf_fit.py").write_text(HF_FIT)
        trains["two fit()s of a Hugging Face Llama"] = [sys.executable, "hf_fit.py"]
    for name, cmd in list(trains.items())[1:]:
        variants[name] = (cmd, {})
    if before is not None:  # the package from another checkout (PYTHONPATH comes before the installed one)
        for name, cmd in trains.items():
            variants[f"{name} ({before.name})"] = (cmd, {"PYTHONPATH": str(before / "src")})
    load_before = os.getloadavg()
    print(f"1. cold start, {rounds} interleaved rounds (seconds of wall time); load average {_load(load_before)}")
    runs: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for cmd, env in variants.values():  # once untimed: the digits cache and the file system's caches are warm
        timed(cmd, env, scratch)
    for _ in range(rounds):
        for name, (cmd, env) in variants.items():
            runs[name].append(timed(cmd, env, scratch, cpu[name]))
    med = print_medians(runs, 48, " s")
    if all(cpu.values()):
        print("  seconds of CPU, every process of the command's:")
        print_medians(cpu, 48, " s")
    ratios = {name: med[name] / med["import torch"] for name in variants}
    # each round's own ratio: a change of load between rounds cancels out of it
    paired = {name: statistics.median(t / base for t, base in zip(runs[name], runs["import torch"]))
              for name in variants}
    for name in variants:
        print(f"  {name:<48} {ratios[name]:5.2f} x import torch (medians), {paired[name]:5.2f} x (paired)")
    load_after = os.getloadavg()
    print(f"  load average {_load(load_after)} at the end")
    return {"seconds": runs, "cpu_seconds": cpu, "medians": med, "ratios_to_import_torch": ratios,
            "paired_ratios_to_import_torch": paired, "load_average_before": load_before,
            "load_average_after": load_after}


def _load(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.1f}" for x in load) + " (1, 5, 15 min)"


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
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds of part 1")
    p.add_argument("--before", default=None,
                   help="also time phalanx train from this checkout's src/ (the code before a change), interleaved")
    p.add_argument("--compare-repeats", type=int, default=1, help="times each comparison runs in part 2 (0: skip)")
    p.add_argument("--link", default=None, help="also time phalanx train on a shaped link of this rate (root)")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="also time phalanx train reading a Dataset with this many loader workers per rank")
    p.add_argument("--hugging-face", action="store_true",
                   help="also time a script that fits a small Hugging Face Llama twice on 2 workers (transformers)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        cold = cold_start(args.rounds, scratch, Path(args.before) if args.before else None, args.link,
                          args.loader_workers, args.hugging_face)
        compared = comparison(scratch, args.compare_repeats) if args.compare_repeats else None
    name = ("startup" + ("-link" if args.link else "") + ("-loader" if args.loader_workers else "")
            + ("-hf" if args.hugging_face else ""))
    save_result(name, args, cold_start=cold, compare=compared)


if __name__ == "__main__":
    main()
