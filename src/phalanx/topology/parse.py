"""Read what ``nvidia-smi topo -m`` and ``nvidia-smi topo -p2p rw`` print.

Both come in two layouts in the wild (and in ``shared/fixtures/topology``): tab-separated, as
nvidia-smi writes to a pipe (with an empty column before ``GPU NUMA ID`` on newer drivers), and
space-aligned, as pasted from a terminal; a terminal copy may also carry ANSI underline codes in
the header. Only GPU rows matter here; NIC rows and the legend are skipped, but NIC columns are
counted so that the affinity columns after them are read correctly.
"""

from __future__ import annotations

import dataclasses
import re

from ..errors import PhalanxError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GPU = re.compile(r"^GPU(\d+)$")
#: Header words that start the per-GPU affinity columns (everything before them is a device).
_AFFINITY_WORDS = ("Affinity", "NUMA")


@dataclasses.dataclass
class TopoMatrix:
    """The GPU part of ``nvidia-smi topo -m``: link type per pair and each GPU's affinities."""

    gpus: list[int]
    links: list[list[str]]
    cpu_affinity: list[str]
    numa_affinity: list[str]


def _cells(line: str) -> list[str]:
    if "\t" in line:
        return [c.strip() for c in line.split("\t")]
    return line.split()


def _header(lines: list[str]) -> tuple[int, list[str], list[str]]:
    """(line index, device column names, affinity column names)."""
    for i, line in enumerate(lines):
        tokens = line.split()
        # The header names GPU0 too, but a row has its own cell "X" right after its name.
        if "GPU0" in tokens and (len(tokens) < 2 or tokens[tokens.index("GPU0") + 1:][:1] != ["X"]):
            if "\t" in line:
                names = [c.strip() for c in line.split("\t") if c.strip()]
            else:
                names = [c for c in re.split(r"\s{2,}", line.strip()) if c]
            split = next((k for k, n in enumerate(names) if any(w in n for w in _AFFINITY_WORDS)), len(names))
            return i, names[:split], names[split:]
    raise PhalanxError("no 'GPU0' header found: pass the output of `nvidia-smi topo -m` (or `topo -p2p rw`)")


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse ``nvidia-smi topo -m`` output."""
    lines = [_ANSI.sub("", ln).rstrip("\n") for ln in text.splitlines()]
    at, devices, affinity = _header(lines)
    gpu_cols = [k for k, name in enumerate(devices) if _GPU.match(name)]
    rows: dict[int, list[str]] = {}
    cpu: dict[int, str] = {}
    numa: dict[int, str] = {}
    for line in lines[at + 1:]:
        cells = [c for c in _cells(line)]
        cells = cells[1:] if cells and cells[0] == "" else cells  # p2p rows start with a space/tab
        gpu = _GPU.match(cells[0]) if cells else None
        if gpu is None:
            continue
        index = int(gpu.group(1))
        values = cells[1:1 + len(devices)]
        if len(values) < len(devices):
            raise PhalanxError(f"row {cells[0]} has {len(values)} cells but the header names {len(devices)} devices")
        rows[index] = [values[k] for k in gpu_cols]
        extra = dict(zip(affinity, [c for c in cells[1 + len(devices):] if c]))
        cpu[index] = extra.get("CPU Affinity", "")
        numa[index] = extra.get("NUMA Affinity", "")
    gpus = sorted(rows)
    if not gpus or gpus != list(range(len(gpus))) or len(gpus) != len(gpu_cols):
        raise PhalanxError(f"GPU rows {gpus} do not match the header's GPU columns; is this a whole `nvidia-smi "
                           "topo -m` output?")
    links = [[_normal(rows[i][j]) for j in gpus] for i in gpus]
    return TopoMatrix(gpus, links, [cpu[i] for i in gpus], [numa[i] for i in gpus])


def _normal(cell: str) -> str:
    cell = cell.strip().upper()
    return "SYS" if cell == "SOC" else cell  # older drivers said SOC for SYS


def parse_p2p_matrix(text: str) -> list[list[bool]]:
    """Parse ``nvidia-smi topo -p2p rw`` (or ``r``/``w``/``n``): True where the status is OK."""
    m = parse_topo_matrix(text)
    return [[cell == "OK" or i == j for j, cell in enumerate(row)] for i, row in enumerate(m.links)]
