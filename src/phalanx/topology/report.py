"""The table people read (``phalanx topology``); ``--json`` prints ``Topology.to_json()`` instead."""

from __future__ import annotations

from .model import Topology, describe_link
from .probe import remedy


def describe(topo: Topology) -> str:
    lines = [f"source: {topo.source}"]
    if topo.gpus:
        lines += _gpu_table(topo)
    else:
        lines.append("GPUs: none")
    if topo.cpu is not None:
        c = topo.cpu
        lines.append(f"CPU: {_n(c.sockets, 'socket')}, {_n(c.numa_nodes, 'NUMA node')}, {_n(c.cores, 'core')}, "
                     f"{_n(c.threads, 'logical CPU')} ({c.usable} usable by this process)"
                     + (f", {c.model}" if c.model else ""))
    for r in topo.probe:
        lines.append(_probe_line(r))
    return "\n".join(lines)


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _gpu_table(topo: Topology) -> list[str]:
    n = len(topo.gpus)
    names = f" ({', '.join(sorted(set(topo.names)))})" if topo.names else ""
    out = [f"GPUs: {n}{names}"]
    header = "      " + "".join(f"GPU{j:<4}" for j in topo.gpus) + "CPU affinity   NUMA"
    out.append(header)
    for i in topo.gpus:
        cells = "".join(f"{topo.links[i][j]:<7}" for j in topo.gpus)
        cpu = topo.cpu_affinity[i] if i < len(topo.cpu_affinity) else ""
        numa = topo.numa_affinity[i] if i < len(topo.numa_affinity) else ""
        out.append(f"GPU{i:<3}{cells}{cpu:<15}{numa}")
    kinds = sorted({topo.links[i][j] for i in topo.gpus for j in topo.gpus if i != j})
    if kinds:
        out.append("links: " + "; ".join(f"{k} = {describe_link(k)}" for k in kinds))
    if topo.peer is not None:
        missing = [f"{i}-{j}" for i in topo.gpus for j in topo.gpus
                   if i < j and not (topo.peer[i][j] and topo.peer[j][i])]
        out.append("peer access: " + ("every pair" if not missing else "none between " + ", ".join(missing)))
    islands = topo.islands()
    out.append("islands (devices that all reach each other directly): "
               + " ".join("[" + ", ".join(map(str, isl)) + "]" for isl in islands))
    if len(islands) > 1 and any(len(i) > 1 for i in islands):
        out.append("  reductions: --reduce auto reduces within each island first, then across one leader per island")
    return out


def _probe_line(r: dict) -> str:
    line = (f"probe {r['src']} -> {r['dst']} ({r['link']}): {r['gbps']:.1f} GB/s, "
            f"bytes {'ok' if r['correct'] else 'WRONG'}")
    fix = remedy(r)
    return line + (f"\n  {fix}" if fix else "")
