"""Topology: which devices reach each other directly, checked, and used to group reductions."""

from .detect import cpu_info, detect_topology
from .model import CpuInfo, Topology, order_by_islands, rank_islands
from .parse import parse_p2p_matrix, parse_topo_matrix

__all__ = ["CpuInfo", "Topology", "cpu_info", "detect_topology", "order_by_islands", "parse_p2p_matrix",
           "parse_topo_matrix", "rank_islands"]
