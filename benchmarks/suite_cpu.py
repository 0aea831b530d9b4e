"""Where the test suite's time goes: each test's CPU, its jobs' processes included, and how busy the cores were.

The suite is bound by the machine's cores (two here): its wall time is the CPU its tests use divided by the
cores, so the measure of a test is its CPU, not its wall time (which says more about what ran beside it).
A test's CPU cannot be read from ``os.times()``: a job's workers are children of a fork server that is not
the test's child, and are never waited for by it. Here each pytest-xdist worker puts itself in a cgroup of
its own (cgroup v1 ``cpuacct``, root only), which every process it starts inherits, so the cgroup's usage
before and after a test is the test's CPU, whoever ran it.

As a pytest plugin, from the repository root (writes one JSON line per test)::

    PYTHONPATH=benchmarks python3 -m pytest -p suite_cpu            # the whole suite, -n 6 as configured
    python3 benchmarks/suite_cpu.py [--top 40]                      # the files and tests that cost the most

Results go to ``benchmarks/results/suite-cpu.jsonl`` (``SUITE_CPU_OUT`` to change), with ``/proc/stat``'s
busy share of the cores over the run in the report.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

OUT = Path(os.environ.get("SUITE_CPU_OUT", Path(__file__).resolve().parent / "results" / "suite-cpu.jsonl"))
CPUACCT = Path("/sys/fs/cgroup/cpuacct")

_group: Optional[Path] = None
_busy_at_start: Optional[tuple[float, float]] = None


def _busy() -> tuple[float, float]:
    """The cores' busy and total jiffies since boot (``/proc/stat``'s first line)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def _usage() -> float:
    return int((_group / "cpuacct.usage").read_text()) / 1e9 if _group is not None else 0.0


def pytest_configure(config: Any) -> None:
    global _group, _busy_at_start
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:  # the controller: the run's start, for the cores' busy share
        _busy_at_start = _busy()
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text("")
        return
    if not CPUACCT.is_dir():
        return
    _group = CPUACCT / f"phalanx-suite-{worker}"
    _group.mkdir(exist_ok=True)
    (_group / "cgroup.procs").write_text(str(os.getpid()))


def pytest_unconfigure(config: Any) -> None:
    if _busy_at_start is None:
        return
    import platform

    import torch

    busy, total = _busy()
    with OUT.open("a") as f:
        f.write(json.dumps({"run": True, "busy_share": (busy - _busy_at_start[0]) / (total - _busy_at_start[1]),
                            "cores": os.cpu_count(), "machine": platform.processor() or platform.machine(),
                            "python": platform.python_version(), "torch": torch.__version__,
                            "workers": getattr(config.option, "numprocesses", None)}) + "\n")


try:
    import pytest
except ImportError:  # (the report needs no pytest)
    pytest = None

if pytest is not None:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: Any, nextitem: Any):
        cpu, wall = _usage(), time.time()
        yield
        with OUT.open("a") as f:
            f.write(json.dumps({"test": item.nodeid, "cpu_s": _usage() - cpu, "wall_s": time.time() - wall,
                                "measured": _group is not None}) + "\n")


def report(top: int) -> None:
    rows = [json.loads(line) for line in OUT.read_text().splitlines() if line.strip()]
    tests = [r for r in rows if "test" in r]
    run = next((r for r in rows if r.get("run")), None)
    print(f"{len(tests)} tests, {sum(r['cpu_s'] for r in tests):.0f} s of CPU, "
          f"{sum(r['wall_s'] for r in tests):.0f} test-seconds of wall time"
          + (f"; the cores busy {run['busy_share']:.0%} of the run ({run['cores']} cores)" if run else ""))
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for r in tests:
        costs = files[r["test"].split("::")[0]]
        costs[0] += r["cpu_s"]
        costs[1] += 1
    print("\nCPU s  tests  file")
    for name, (cpu, count) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{cpu:6.0f} {count:6.0f}  {name}")
    print("\nCPU s  wall s  test")
    for r in sorted(tests, key=lambda r: -r["cpu_s"])[:top]:
        print(f"{r['cpu_s']:6.1f} {r['wall_s']:7.1f}  {r['test']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=30, help="how many files and tests to list")
    report(parser.parse_args().top)
