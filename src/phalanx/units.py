"""Units as people write them: ``25GB/s``, ``200Gb/s``, ``10us``, ``1,2,4,64``; and back to text.

Pure functions. Bandwidths are bytes per second, durations seconds. Decimal prefixes are powers
of 1000 (``GB/s`` = 1e9 bytes/s, as nccl-tests and NIC datasheets count), binary ones powers of
1024 (``GiB/s``); a lower-case ``b`` means bits (``200Gb/s`` = 25e9 bytes/s).
"""

from __future__ import annotations

import math
import re

from .errors import PhalanxError

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40}
_BANDWIDTH = re.compile(r"^\s*([0-9.eE+-]+)\s*(Ki|Mi|Gi|Ti|k|K|M|G|T|)(B|b|bit|Byte|byte)(?:/s|ps)\s*$")
_DURATION = re.compile(r"^\s*([0-9.eE+-]+)\s*(ns|us|µs|μs|ms|s)\s*$")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0}


def check_link_pair(bandwidth, latency) -> None:
    """``--link-bandwidth`` and ``--link-latency`` come together or not at all: a link is both."""
    if (bandwidth is None) != (latency is None):
        given = "--link-bandwidth" if latency is None else "--link-latency"
        missing = "--link-latency" if latency is None else "--link-bandwidth"
        raise PhalanxError(f"{given} needs {missing} too: a link is its bandwidth and its latency "
                           "(e.g. --link-bandwidth 25GB/s --link-latency 10us)")


def _number(text: str, what: str, example: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise PhalanxError(f"{what} {text!r} is not a number with a unit, e.g. {example}") from None
    if not (value > 0 and math.isfinite(value)):
        raise PhalanxError(f"{what} must be positive and finite, got {text!r} (e.g. {example})")
    return value


def parse_bandwidth(text: str) -> float:
    """``25GB/s`` -> 25e9 bytes/s; ``200Gb/s`` -> 25e9; ``12GiB/s`` -> 12·2^30."""
    match = _BANDWIDTH.match(str(text))
    if match is None:
        raise PhalanxError(f"--link-bandwidth {text!r} is not a bandwidth like 25GB/s, 200Gb/s or 900MB/s")
    value = _number(match.group(1), "--link-bandwidth", "25GB/s")
    bits = match.group(3) in ("b", "bit")
    return value * _PREFIX[match.group(2)] / (8.0 if bits else 1.0)


def parse_duration(text: str) -> float:
    """``10us`` -> 1e-5 s (also ``µs``, ``ns``, ``ms``, ``s``); a bare number is refused as ambiguous."""
    match = _DURATION.match(str(text))
    if match is None:
        raise PhalanxError(f"--link-latency {text!r} is not a duration with a unit like 10us, 2.5us or 0.1ms")
    return _number(match.group(1), "--link-latency", "10us") * _SECONDS[match.group(2)]


#: The most workers an estimate predicts. Its network is one α–β link within a machine and one
#: between machines, checked against real runs of a few workers; at a million workers (ten times
#: the largest training jobs) a prediction would describe no network that exists.
MAX_WORKERS = 1_000_000


def parse_workers(text: str) -> tuple[int, ...]:
    """``1,2,4,64`` -> (1, 2, 4, 64): positive whole numbers up to :data:`MAX_WORKERS`, sorted, each once."""
    parts = [part.strip() for part in str(text).split(",")]
    if not all(parts):
        raise PhalanxError(f"--workers {text!r} has an empty entry: give worker counts separated by single commas, "
                           "like 1,2,4,8")
    try:
        counts = [int(part) for part in parts]
    except ValueError:
        raise PhalanxError(f"--workers {text!r} is not a list of worker counts like 1,2,4,8,64") from None
    if any(c < 1 for c in counts):
        raise PhalanxError(f"--workers {text!r}: every worker count must be 1 or more, e.g. 1,2,4,8")
    if max(counts) > MAX_WORKERS:
        raise PhalanxError(f"--workers {max(counts)} is more than phalanx estimate predicts ({MAX_WORKERS:,}): its "
                           "network model (one α–β link per tier) describes no network of that size; ask for "
                           f"{MAX_WORKERS:,} or fewer")
    return tuple(sorted(set(counts)))


def fmt_seconds(seconds: float) -> str:
    """A duration in the unit that reads best: ``118 µs``, ``4.31 ms``, ``1.2 s``."""
    if seconds < 0.9995e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 0.9995:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def fmt_bytes(count: float) -> str:
    """``605 kB``, ``80.6 MB``, ``1 GB`` (a unit is taken once the figure would round to 1000 of the one below)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size * 0.9995:
            return f"{count / size:.3g} {unit}"
    return f"{count:.0f} B"


def fmt_bandwidth(bytes_per_s: float) -> str:
    return f"{fmt_bytes(bytes_per_s)}/s"
