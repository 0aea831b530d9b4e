"""``phalanx topology``: what this machine's devices are and which reach each other directly."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import PhalanxError
from .detect import cpu_info, detect_topology
from .model import Topology
from .probe import run_probe
from .report import describe


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--probe", action="store_true", help="copy a buffer across every GPU pair: bandwidth, bytes")
    p.add_argument("--probe-mb", type=int, default=256, help="buffer size for --probe, in MiB")
    p.add_argument("--from-file", help="read a saved `nvidia-smi topo -m` output instead of this machine")
    p.add_argument("--p2p-file", help="with --from-file: a saved `nvidia-smi topo -p2p rw` output")


def run(args: argparse.Namespace) -> int:
    if args.from_file:
        topo = Topology.from_nvidia_smi(_read(args.from_file), _read(args.p2p_file) if args.p2p_file else None,
                                        source=f"file {args.from_file}")
        if args.probe:
            raise PhalanxError("--probe measures this machine; drop --from-file to probe")
    else:
        topo = detect_topology()
        topo.cpu = topo.cpu or cpu_info()
        if args.probe:
            topo.probe = run_probe(topo, args.probe_mb)
    print(topo.to_json() if args.json else describe(topo))
    return 0


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise PhalanxError(f"cannot read {path}: {e.strerror}; pass a file saved from `nvidia-smi topo -m`") from None
