"""What every benchmark records beside its figures: the machine, the versions, the spread."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info() -> dict:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    info = {
        "host": socket.gethostname(), "platform": platform.platform(), "processor": platform.processor(),
        "cpu_count": cores, "python": sys.version.split()[0], "torch": torch.__version__,
        "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser, with ``--save``: only a run asked to replaces the figures the README quotes."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save", action="store_true",
                   help="write the result under benchmarks/results/ (replacing the one the README and docs quote); "
                        "without it the result goes to a scratch file in the system's temporary directory")
    return p


def result_path(name: str, save: bool) -> Path:
    """benchmarks/results/<name>-<cpu|gpu model>.json (one file per benchmark and kind of machine) when
    ``save``; else the same name in a scratch folder, so a trial run never overwrites a quoted result."""
    kind = torch.cuda.get_device_name(0).replace(" ", "_") if torch.cuda.is_available() else f"cpu{os.cpu_count()}"
    folder = RESULTS if save else Path(tempfile.gettempdir()) / "phalanx-benchmarks"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}-{kind}.json"


def spread(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


def save_result(name: str, args: argparse.Namespace, **payload) -> Path:
    """Write the result with the machine and versions (see :func:`result_path` for where); say where."""
    out = result_path(name, args.save)
    out.write_text(json.dumps({"benchmark": name, "machine": machine_info(), "args": vars(args), **payload},
                              indent=2) + "\n")
    print(f"\nsaved {out}" + ("" if args.save else " (a scratch copy: --save writes it under benchmarks/results/)"))
    return out


def print_medians(runs: dict[str, list[float]], width: int, unit: str = "") -> dict[str, float]:
    """One line per variant: median and min-max; returns the medians."""
    med = {name: statistics.median(v) for name, v in runs.items()}
    for name, values in runs.items():
        lo, hi = spread(values)
        print(f"  {name:<{width}} {med[name]:8.1f}{unit}  ({lo:.1f}-{hi:.1f})")
    return med


def bootstrap_median(values: list[float], resamples: int = 4000, level: float = 0.95, seed: int = 0
                     ) -> tuple[float, float]:
    """A percentile bootstrap interval of the median of ``values`` (paired ratios: one per round): the
    ``level`` interval of the medians of ``resamples`` draws with replacement (seeded: a result file says the
    same every time it is read again)."""
    import random

    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    cut = int(resamples * (1 - level) / 2)
    return medians[cut], medians[-cut - 1]
