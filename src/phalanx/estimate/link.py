"""The link between workers as two numbers, α (seconds per message) and β (seconds per byte).

A message of S bytes over a link costs α + S·β. A ring all-reduce of S bytes over N ranks
(Thakur, Rabenseifner and Gropp 2005) takes 2(N−1) steps, each moving S/N bytes between
neighbours at once, so T = 2(N−1)·α + 2(N−1)/N · S·β. 1/β is then what nccl-tests reports as
the *bus bandwidth* (busbw = S/T · 2(N−1)/N), the figure that does not depend on N; that is the
convention of ``--link-bandwidth``.

Where the figures come from (each :class:`Link` carries its ``source``):

- ``--link-bandwidth`` / ``--link-latency``: given by the user, for hardware that is not here;
- ``--measure-link``: :func:`measure_link` times all-reduces of several sizes between 2 local
  ranks over this machine's backend (gloo on CPU, NCCL between two GPUs) through phalanx's own
  launcher, and :func:`fit_ring` solves for α and β by least squares;
- GPUs here: :func:`gpu_link` gives a default per link type of ``phalanx topology`` (the table
  below names the datasheet or source file of every figure).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Optional, Sequence

import numpy as np

from ..costs.link import Link, ring_terms
from ..errors import PhalanxError
from ..units import fmt_bandwidth, fmt_seconds


def describe_link(link: Link) -> str:
    """``10 GB/s, 5 µs per message (given by ...)``: the figures and where they come from."""
    return f"{fmt_bandwidth(link.bandwidth)}, {fmt_seconds(link.alpha)} per message ({link.source})"


def fit_ring(sizes: Sequence[float], seconds: Sequence[float], ranks: int = 2, source: str = "fitted") -> Link:
    """α and β from timed ring all-reduces of ``sizes`` bytes over ``ranks`` ranks (least squares).

    Each timing is weighted by its inverse, so small messages (which fix α) count as much as
    large ones (which fix β): the fit minimises relative, not absolute, error. A negative α (the
    smallest messages cost nothing measurable) is refitted as α = 0.
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise PhalanxError("fitting α and β needs at least two all-reduce timings of different sizes")
    if ranks < 2:
        raise PhalanxError("fitting α and β needs all-reduces over at least 2 ranks")
    t = np.asarray(seconds, dtype=float)
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise PhalanxError(f"all-reduce timings must be positive seconds, got {list(seconds)}")
    a = np.array([ring_terms(ranks, s) for s in sizes], dtype=float) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha = 0.0
        beta = float(np.linalg.lstsq(a[:, 1:], np.ones_like(t), rcond=None)[0][0])
    if not beta > 0:
        raise PhalanxError("the all-reduce timings do not grow with the message size, so no bandwidth can be "
                           "fitted; measure again on a quieter machine, or give --link-bandwidth/--link-latency")
    return Link(float(alpha), float(beta), source)


# --------------------------------------------------------------------------- default figures for GPU links

#: Bandwidth per NVLink link and direction. NVIDIA's datasheets give the total for both
#: directions and every link: V100 300 GB/s over 6 links, A100 600 GB/s over 12, H100 900 GB/s
#: over 18, i.e. 25 GB/s per link and direction for NVLink 2, 3 and 4 alike. ``nvidia-smi topo -m``
#: writes ``NV<k>`` for k links between a pair.
NVLINK_PER_LINK = 25e9
#: PCIe 4.0 x16 per direction: 16 GT/s × 16 lanes × 128/130 encoding / 8 bits (PCI-SIG, PCIe 4.0
#: base specification). The generation is not in the topology matrix; 4.0 is the A100/H100-era bus.
PCIE4_X16 = 31.5e9
#: Latency per ring step, from NCCL's own performance model (``hwLat``, Ring / Simple protocol, in
#: src/graph/tuning.cc of NVIDIA/nccl): 3.4 µs over NVLink, 5.7 µs over PCIe.
NVLINK_STEP_LATENCY = 3.4e-6
PCIE_STEP_LATENCY = 5.7e-6


def gpu_link(word: str) -> Link:
    """The default figures for one link type of ``nvidia-smi topo -m`` (``NV12``, ``PIX``, ``SYS`` ...)."""
    if word.startswith("NV"):
        count = int(word[2:]) if word[2:].isdigit() else 1
        return Link(NVLINK_STEP_LATENCY, 1.0 / (count * NVLINK_PER_LINK),
                    f"NVLink x{count}: {count} x 25 GB/s per direction (NVIDIA V100/A100/H100 datasheets); "
                    "3.4 µs per step (NCCL tuning.cc)")
    what = {"PIX": "one PCIe switch", "PXB": "PCIe switches", "PHB": "PCIe host bridge", "NODE": "PCIe within a "
            "NUMA node", "SYS": "PCIe across sockets", "P2P": "PCIe peer access"}.get(word, f"link {word}")
    return Link(PCIE_STEP_LATENCY, 1.0 / PCIE4_X16,
                f"{what}: PCIe 4.0 x16, 31.5 GB/s per direction (PCI-SIG); 5.7 µs per step (NCCL tuning.cc)")


def ring_of_gpus(links: Sequence[Sequence[str]], gpus: int) -> Optional[Link]:
    """The slowest link of the ring 0 → 1 → … → gpus−1 → 0 (what bounds a ring all-reduce); None for one GPU."""
    if gpus < 2:
        return None
    pairs = [(i, (i + 1) % gpus) for i in range(gpus)]
    return max((gpu_link(links[i][j]) for i, j in pairs), key=lambda link: (link.beta, link.alpha))


# --------------------------------------------------------------------------- measuring this machine's link

#: All-reduce sizes timed by --measure-link: 4 KiB to 64 MiB, each 4x the last.
PROBE_SIZES = tuple(4096 * 4 ** k for k in range(8))


def time_allreduces(ctx, sizes: Sequence[int], repeats: int) -> list[float]:
    """Inside a worker: the median seconds of an all-reduce of each size (float32), after 2 warm-ups.

    A barrier before each timed call starts every rank together, so a timing is the collective's
    own time, not a wait for a late peer. Rank 0's medians are returned (every rank times the same).
    """
    import torch
    import torch.distributed as dist

    out = []
    for size in sizes:
        tensor = torch.ones(max(1, size // 4), device=ctx.device)
        samples = []
        for i in range(repeats + 2):
            dist.barrier()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            start = time.perf_counter()
            dist.all_reduce(tensor)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            if i >= 2:
                samples.append(time.perf_counter() - start)
        out.append(statistics.median(samples))
    return out


def measure_link(device_type: str, sizes: Sequence[int] = PROBE_SIZES, repeats: int = 10) -> tuple[Link, list]:
    """Time all-reduces between 2 local ranks (gloo on CPU, NCCL on cuda:0 and cuda:1) and fit α, β.

    Returns the link and the (bytes, seconds) samples it was fitted on.
    """
    import torch

    from ..launcher import launch

    if device_type == "cuda":
        if torch.cuda.device_count() < 2:
            raise PhalanxError("--measure-link on GPUs needs 2 GPUs here to time a link between them, and this "
                               f"machine has {torch.cuda.device_count()}; give --link-bandwidth and --link-latency")
        devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
        backend = "NCCL"
    else:
        devices = [torch.device("cpu")] * 2
        backend = "gloo"
    seconds = launch(time_allreduces, devices, (list(sizes), repeats), threads=1 if device_type == "cpu" else None)
    source = (f"measured here: {backend} all-reduces of {len(sizes)} sizes ({sizes[0] // 1024} KiB to "
              f"{sizes[-1] // 2 ** 20} MiB) between 2 local ranks, least-squares fit")
    link = dataclasses.replace(fit_ring(sizes, seconds, 2, source), shared_copy=device_type == "cpu")
    return link, list(zip(sizes, seconds))
