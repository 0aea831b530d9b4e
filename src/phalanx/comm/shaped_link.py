"""A real slow link: the job runs in a private network namespace whose loopback the kernel shapes.

    phalanx train --link 50mbit --steps 100          # every byte between workers crosses 50 Mbit/s

What happens: for the length of the job, the launching thread moves into a new network namespace
(``unshare(CLONE_NEWNET)``), brings its loopback up with an MTU of 1,500 bytes and puts traffic
control's token bucket filter on it (``tc qdisc add dev lo root tbf rate RATE ...``). The job's
rendezvous store and its progress board are created from that thread, and every worker, forked by the
fork server outside the namespace, joins it before anything else (:func:`join`), so they all live in the
namespace and talk over 127.0.0.1 there: every strategy's gloo traffic crosses the shaped link, and
nothing is simulated. Afterwards the thread returns to its own namespace;
the namespace disappears with the job's last socket. Files (checkpoints, metrics) are unaffected:
a network namespace changes nothing on the filesystem.

What it models: one shared bottleneck of RATE for all ranks together (the loopback's single
queue), not a NIC per node, and bandwidth only: latency stays the loopback's (``netem``, which
would add delay, is not available everywhere). The loopback's own counters (``/proc/net/dev``)
in the namespace count exactly the job's traffic, TCP/IP headers and rendezvous included; the
trainer records them as ``link_bytes``.

Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) and the ``ip`` and ``tc`` commands (iproute2);
where either is missing the job is refused before anything starts, in one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import threading
import time
from typing import Any, Iterator, Optional

from ..errors import PhalanxError

CLONE_NEWNET = 0x40000000  #: <linux/sched.h>

#: tc's rate units phalanx accepts: SI bits per second, and tc's byte forms (``mbps`` is megaBYTES per second).
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
         "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
MIN_BITS_PER_S = 1e3
MTU = 1500  #: an Ethernet frame's payload: TCP segments the size a real network carries
#: a smaller burst leaves a TCP stream short of the rate (the figure: benchmarks/README.md, "Figures behind
#: the code")
MIN_BURST_BYTES = 256 * 1024
BURST_SECONDS = 0.004  #: at high rates the bucket holds 4 ms of traffic, or tbf falls short of the rate
LATENCY = "100ms"  #: how long a packet may wait in tbf's queue before it is dropped (TCP then backs off)


class LinkUnavailable(PhalanxError):
    """This machine or user cannot make a shaped link (no namespaces, no traffic control)."""


@dataclasses.dataclass(frozen=True)
class LinkRate:
    """A link's rate, as the user wrote it and in bits per second."""

    text: str  #: "50mbit"
    bits_per_s: float

    def __post_init__(self) -> None:
        if not self.bits_per_s >= MIN_BITS_PER_S:  # also refuses NaN
            raise PhalanxError(f"--link {self.text}: a link's rate must be at least 1kbit, e.g. 50mbit")

    def describe(self) -> str:
        """``50 Mbit/s`` (``12mbps``, tc's bytes per second, is ``96 Mbit/s``)."""
        for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
            if self.bits_per_s >= scale:
                return f"{self.bits_per_s / scale:g} {unit}"
        return f"{self.bits_per_s:g} bit/s"

    @property
    def burst_bytes(self) -> int:
        return max(MIN_BURST_BYTES, round(self.bits_per_s / 8 * BURST_SECONDS))

    def tc_args(self) -> list[str]:
        return ["qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{round(self.bits_per_s)}bit",
                "burst", str(self.burst_bytes), "latency", LATENCY]


def parse_rate(text: Any, flag: str = "--link ") -> LinkRate:
    """``50mbit`` -> 50e6 bits/s; ``12mbps`` -> 96e6 (tc's byte form). A unit is required.
    ``flag`` is how messages name the value: ``--link 50mbit``, or ``link:50mbit`` in a scenario."""
    if isinstance(text, LinkRate):
        return text
    written = str(text).strip().lower()
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?([a-z]+)", written)
    if match is None or match.group(2) not in UNITS:
        raise PhalanxError(f"{flag}{written or repr(written)} is not a rate: give a number and a unit, kbit, mbit or "
                           "gbit (bits per second) or kbps, mbps, gbps (bytes per second, as tc reads them), "
                           f"e.g. {flag}50mbit")
    number = float(written[:-len(match.group(2))])
    if not math.isfinite(number):
        raise PhalanxError(f"{flag}{written} is not a finite rate; give e.g. {flag}50mbit")
    if number <= 0:
        raise PhalanxError(f"{flag}{written}: a link's rate must be positive, e.g. {flag}50mbit")
    if number * UNITS[match.group(2)] < MIN_BITS_PER_S:
        raise PhalanxError(f"{flag}{written}: a link's rate must be at least 1kbit, e.g. {flag}50mbit")
    return LinkRate(written, number * UNITS[match.group(2)])


# ---- before anything starts ----

def check(rate: LinkRate, *, devices: list, world_size: int, addr: str, joined: bool) -> None:
    """The job phalanx would start can run on a shaped loopback, and this machine can make one (it is
    made once and dropped): else one line naming the fix, before anything starts."""
    if joined:
        raise PhalanxError(f"--link {rate.text} shapes a job phalanx starts on one machine; under torchrun or "
                           "srun the network is theirs to shape: drop --link")
    if world_size < 2:
        raise PhalanxError(f"--link {rate.text} shapes the traffic between processes, and this job has one; "
                           "give --workers 2 or more")
    if any(getattr(d, "type", "cpu") != "cpu" for d in devices):
        raise PhalanxError(f"--link {rate.text} shapes gloo's traffic over the loopback; NCCL between GPUs of one "
                           "machine goes over NVLink, PCIe or shared memory and would not cross it: add --devices cpu")
    if not (addr.startswith("127.") or addr == "localhost"):
        raise PhalanxError(f"--link {rate.text} runs the job on the loopback of a private network namespace, where "
                           f"--master-addr {addr} does not exist: drop --master-addr (default 127.0.0.1)")
    probe(rate)


# ---- the namespace ----

def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _tool(name: str) -> str:
    """``ip`` or ``tc``: on PATH, or in the sbin folders a non-root PATH often lacks."""
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if found is None:
        raise LinkUnavailable(f"a shaped link needs the {name} command, which is not installed: install iproute2 "
                              "(apt-get install iproute2), or use the simulation (compare --simulate) instead")
    return found


def _enter(rate: LinkRate) -> None:
    """Move this thread into a new network namespace (only this thread: the others stay where they are)."""
    if _libc().unshare(CLONE_NEWNET) != 0:
        why = os.strerror(ctypes.get_errno())
        raise LinkUnavailable(f"the shaped link {rate.text} needs a private network namespace, which this process "
                              f"may not create (unshare: {why}); run it as root with CAP_SYS_ADMIN and CAP_NET_ADMIN "
                              "(a container needs them added), or use the simulation (compare --simulate) instead")


def _shape(rate: LinkRate) -> None:
    """Loopback up, MTU 1,500, tbf at the rate: the kernel now shapes every byte the job sends."""
    ip, tc = _tool("ip"), _tool("tc")
    for command in ([ip, "link", "set", "lo", "mtu", str(MTU)], [ip, "link", "set", "lo", "up"], [tc, *rate.tc_args()]):
        done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise LinkUnavailable(f"the shaped link {rate.text} could not be set up ({os.path.basename(command[0])}: "
                                  f"{said}); run it as root with CAP_NET_ADMIN and the kernel's tbf scheduler, or use "
                                  "the simulation (compare --simulate) instead")


def _setns(namespace: int, which: str) -> None:
    """Move this thread into the network namespace ``namespace`` (a file descriptor); ``which`` names it."""
    if _libc().setns(namespace, CLONE_NEWNET) != 0:  # (the job could enter it once: never expected, never ignored)
        raise OSError(ctypes.get_errno(), f"setns into {which} failed")


class Link:
    """The shaped link the job is running on; reads its byte counters."""

    def __init__(self, rate: LinkRate):
        self.rate = rate

    def bytes(self) -> int:
        """The bytes the loopback sent in this namespace: exactly the job's traffic so far (see
        :func:`loopback_bytes`)."""
        return loopback_bytes()

    def record(self, summary: Optional[dict], metrics: Optional[str], steps: int) -> Optional[dict]:
        """Add the link's counters to rank 0's summary, the metrics file and the output."""
        if summary is None:
            return None
        counted = self.bytes()
        per_step = counted / steps if steps > 0 else None
        fields = {"link": self.rate.text, "link_bits_per_s": self.rate.bits_per_s, "link_bytes": counted,
                  "link_steps": steps, "link_bytes_per_step": per_step}
        if metrics:
            with open(metrics, "a") as f:
                f.write(json.dumps({"event": "link", "time": round(time.time(), 3), **fields}) + "\n")
        each = f", {size(per_step)} per step" if per_step is not None else ""
        print(f"link {self.rate.text} ({self.rate.describe()}, kernel-shaped loopback): {size(counted)} crossed it"
              f"{each}", flush=True)
        return {**summary, **fields}


def loopback_bytes() -> int:
    """The bytes this thread's loopback has sent: in a shaped link's namespace, exactly the job's
    traffic so far, TCP/IP headers included (each byte crosses it once: its transmit count equals its
    receive count). A worker of the job, whose whole process is in the namespace, reads the same
    counters."""
    return loopback_counters()[0]


def loopback_counters() -> tuple[int, int]:
    """The bytes and the packets this thread's loopback has sent. A packet is a segment of up to 64 kB
    under segmentation offload, or an acknowledgement: each carries one TCP/IP header."""
    with open("/proc/thread-self/net/dev") as f:  # thread-self: the namespace is this thread's
        for line in f:
            name, _, values = line.partition(":")
            if name.strip() == "lo":
                fields = values.split()  # receive: 8 fields, then transmit bytes, packets
                return int(fields[8]), int(fields[9])
    raise OSError("no lo in /proc/thread-self/net/dev")


@contextlib.contextmanager
def shaped(rate: Optional[LinkRate]) -> Iterator[Optional[Link]]:
    """Inside: this thread, and every process and thread it starts, is on a fresh loopback shaped to
    ``rate`` (None: nothing changes). On the way out the thread returns to its own namespace."""
    if rate is None:
        yield None
        return
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _enter(rate)
        _here.home, _here.namespace = home, os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            _shape(rate)
            yield Link(rate)
        finally:
            os.close(_here.namespace)
            _here.home = _here.namespace = None
            _setns(home, "the original network namespace")
    finally:
        os.close(home)


#: while inside :func:`shaped`, the namespaces this thread came from (``home``) and is in (``namespace``), as
#: file descriptors
_here = threading.local()


@contextlib.contextmanager
def outside() -> Iterator[None]:
    """This thread back in its own namespace for a moment, if it is on a shaped link: to start a process that
    outlives the link's job (the workers' fork server)."""
    namespace = getattr(_here, "namespace", None)
    if namespace is None:
        yield
        return
    _setns(_here.home, "the original network namespace")
    try:
        yield
    finally:
        _setns(namespace, "the shaped link's network namespace")


def namespace() -> Optional[int]:
    """The shaped link's namespace this thread is in now (a file descriptor, open while it lasts), or None. A
    process started by this thread is in it; one started elsewhere, such as a worker forked by the fork server,
    joins it with :func:`join`."""
    return getattr(_here, "namespace", None)


def join(namespace_fd: int) -> None:
    """Move this process into a shaped link's namespace: a worker forked outside it, before it starts a thread or
    opens a socket (setns moves the calling thread; the threads it starts later follow). Closes ``namespace_fd``."""
    try:
        _setns(namespace_fd, "the shaped link's network namespace")
    finally:
        os.close(namespace_fd)


def probe(rate: LinkRate) -> None:
    """Make the shaped link once and leave it: refuses, in one line, where it cannot be made."""
    with shaped(rate):
        pass


def size(n: float) -> str:
    """``1.23 MB``: decimal units, as the link's counters are reported."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


__all__ = ["Link", "LinkRate", "LinkUnavailable", "check", "join", "loopback_bytes", "loopback_counters",
           "namespace", "outside", "parse_rate", "probe", "shaped", "size"]
