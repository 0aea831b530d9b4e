"""``phalanx topology``: what this machine's devices are and which reach each other directly."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import PhalanxError
from ..options import _argparse_type
from .detect import cpu_info, detect_topology
from .model import Topology
from .probe import run_probe
from .report import describe


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--probe", action="store_true", help="copy a buffer across every GPU pair: bandwidth, bytes")
    p.add_argument("--probe-mb", type=_argparse_type(probe_mb, "--probe-mb"), default=None,
                   help=f"buffer size for --probe, in MiB (default {PROBE_MB})")
    p.add_argument("--from-file", type=_argparse_type(lambda t: a_file(t, "--from-file"), "--from-file"),
                   help="read a saved `nvidia-smi topo -m` output instead of this machine")
    p.add_argument("--p2p-file", type=_argparse_type(lambda t: a_file(t, "--p2p-file"), "--p2p-file"),
                   help="with --from-file: a saved `nvidia-smi topo -p2p rw` output")


PROBE_MB = 256


def probe_mb(text: str) -> int:
    """--probe-mb: a whole, positive number of MiB (0 or less would copy nothing and report nonsense)."""
    try:
        value = int(text)
    except ValueError:
        raise PhalanxError(f"--probe-mb takes a whole number of MiB, e.g. {PROBE_MB}, got {text!r}") from None
    if value < 1:
        raise PhalanxError(f"--probe-mb must be at least 1 MiB, got {value}")
    return value


def a_file(text: str, flag: str) -> str:
    if not text.strip():
        raise PhalanxError(f"{flag} '' names no file: give the path of a saved nvidia-smi output")
    return text


def run(args: argparse.Namespace) -> int:
    # A flag that would be ignored is refused: the user meant something by it.
    if args.p2p_file is not None and args.from_file is None:
        raise PhalanxError("--p2p-file goes with --from-file (it adds a saved peer matrix to a saved topology)")
    if args.probe_mb is not None and not args.probe:
        raise PhalanxError(f"--probe-mb {args.probe_mb} sizes the buffer of --probe: add --probe")
    if args.from_file:
        topo = Topology.from_nvidia_smi(_read(args.from_file), _read(args.p2p_file) if args.p2p_file else None,
                                        source=f"file {args.from_file}")
        if args.probe:
            raise PhalanxError("--probe measures this machine; drop --from-file to probe")
    else:
        topo = detect_topology()
        topo.cpu = topo.cpu or cpu_info()
        if args.probe:
            topo.probe = run_probe(topo, args.probe_mb or PROBE_MB)
    print(topo.to_json() if args.json else describe(topo))
    return 0


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise PhalanxError(f"cannot read {path}: {e.strerror}; pass a file saved from `nvidia-smi topo -m`") from None
