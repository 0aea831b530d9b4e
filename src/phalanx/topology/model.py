"""``Topology``: which devices reach each other directly, and the islands that follow.

"Directly" means a GPU-to-GPU path that does not cross a CPU host bridge: NVLink (``NV#``) or
PCIe switches only (``PIX``, ``PXB``). ``PHB``, ``NODE`` and ``SYS`` go through the CPU and are
not direct. Where a peer-access matrix is known (``torch.cuda.can_device_access_peer``, or
``nvidia-smi topo -p2p rw``), a pair without peer access is never direct, whatever its link.

An island is a group of devices that all reach each other directly (a clique). Islands are
found by repeatedly taking the largest clique of what is left (exact search: ties go to the
lowest device numbers), so a DGX-1's hybrid cube-mesh gives ``[0-3]`` and ``[4-7]``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any, Optional

from .parse import parse_p2p_matrix, parse_topo_matrix

DIRECT_LINKS = ("PIX", "PXB")
LINK_WORDS = {
    "X": "self", "PIX": "one PCIe switch", "PXB": "several PCIe switches", "PHB": "PCIe host bridge (CPU)",
    "NODE": "host bridges within a NUMA node", "SYS": "across CPU sockets (QPI/UPI)",
}


def link_is_direct(link: str) -> bool:
    return link.startswith("NV") or link in DIRECT_LINKS


def describe_link(link: str) -> str:
    if link.startswith("NV"):
        return f"NVLink x{link[2:] or '?'}"
    return LINK_WORDS.get(link, f"unknown ({link})")


@dataclasses.dataclass
class CpuInfo:
    sockets: int
    numa_nodes: int
    cores: int  # physical
    threads: int  # logical CPUs
    usable: int  # logical CPUs this process may run on
    model: str = ""


@dataclasses.dataclass
class Topology:
    """Devices, the link between every pair, optional peer access, affinities, and the CPU."""

    gpus: list[int] = dataclasses.field(default_factory=list)
    links: list[list[str]] = dataclasses.field(default_factory=list)
    peer: Optional[list[list[bool]]] = None
    cpu_affinity: list[str] = dataclasses.field(default_factory=list)
    numa_affinity: list[str] = dataclasses.field(default_factory=list)
    names: list[str] = dataclasses.field(default_factory=list)
    cpu: Optional[CpuInfo] = None
    source: str = ""
    probe: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @classmethod
    def from_nvidia_smi(cls, text: str, p2p_text: Optional[str] = None, source: str = "nvidia-smi") -> "Topology":
        m = parse_topo_matrix(text)
        peer = parse_p2p_matrix(p2p_text) if p2p_text else None
        return cls(m.gpus, m.links, peer, m.cpu_affinity, m.numa_affinity, source=source)

    @classmethod
    def from_peer_matrix(cls, peer: list[list[bool]], source: str = "peer-access matrix") -> "Topology":
        """Only peer access known (no link types): a pair with peer access counts as direct."""
        n = len(peer)
        links = [["X" if i == j else ("P2P" if peer[i][j] and peer[j][i] else "NONE") for j in range(n)]
                 for i in range(n)]
        return cls(list(range(n)), links, [list(map(bool, r)) for r in peer], source=source)

    def direct(self, i: int, j: int) -> bool:
        if i == j:
            return True
        if self.peer is not None and not (self.peer[i][j] and self.peer[j][i]):
            return False
        link = self.links[i][j]
        return link == "P2P" or link_is_direct(link)

    def islands(self) -> list[list[int]]:
        left = list(self.gpus)
        found = []
        while left:
            best = max_clique(left, self.direct)
            found.append(best)
            left = [g for g in left if g not in best]
        return sorted(found)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["islands"] = self.islands()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def max_clique(nodes: list[int], adjacent) -> list[int]:
    """The largest set of ``nodes`` that are pairwise adjacent; ties: the lexicographically smallest.

    Exact (it tries larger sizes first and stops at the first that exists); machines have at
    most a few dozen GPUs, and real topologies have small cliques, so this stays cheap.
    """
    for size in range(len(nodes), 0, -1):
        for group in itertools.combinations(sorted(nodes), size):
            if all(adjacent(a, b) for a, b in itertools.combinations(group, 2)):
                return list(group)
    return []


def order_by_islands(devices: list[int], islands: list[list[int]]) -> list[int]:
    """``devices`` reordered so that each island's members are consecutive (ranks follow islands)."""
    chosen = set(devices)
    ordered = [d for island in islands for d in island if d in chosen]
    return ordered + [d for d in devices if d not in ordered]


def rank_islands(devices: list[int], islands: list[list[int]]) -> list[list[int]]:
    """Islands in rank space, for workers placed on ``devices`` in that order."""
    position = {d: r for r, d in enumerate(devices)}
    out = [[position[d] for d in island if d in position] for island in islands]
    return sorted(sorted(i) for i in out if i)
