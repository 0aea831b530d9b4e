"""``--probe``: copy a buffer across every pair of GPUs, time it, and check the bytes.

Runs in a child process. For each ordered pair (i, j) a buffer with a known byte pattern is
copied from GPU i to GPU j several times; the median time gives the bandwidth, and the bytes
that arrived are compared with what was sent. A pair whose bytes differ is broken (peer copies
that return wrong data exist on some consumer cards); a pair far below what its link type
promises is slow. With one GPU the host-to-device and device-to-host copies (pinned memory)
are measured instead, so the probe always says something true about the machine.
"""

from __future__ import annotations

from typing import Any

from .detect import run_in_child
from .model import Topology

#: The least bandwidth (GB/s) each link type should deliver for a large copy; far below is "slow".
FLOOR_GBPS = {"NV": 15.0, "PIX": 5.0, "PXB": 5.0, "PHB": 3.0, "NODE": 3.0, "SYS": 2.0, "HOST": 3.0}

_PROBE = """
import json, statistics, time, torch
size = {size}
n = torch.cuda.device_count()
pattern = (torch.arange(size, dtype=torch.int64) % 251).to(torch.uint8)

def timed(copy, sync_devices):
    times = []
    for _ in range({repeats}):
        for d in sync_devices: torch.cuda.synchronize(d)
        start = time.perf_counter()
        out = copy()
        for d in sync_devices: torch.cuda.synchronize(d)
        times.append(time.perf_counter() - start)
    return out, statistics.median(times[1:] or times)

results = []
for i in range(n):
    src = pattern.to(i)
    for j in range(n):
        if i == j: continue
        out, t = timed(lambda: src.to(j), [i, j])
        results.append({{"src": i, "dst": j, "gbps": size / t / 1e9, "correct": bool(torch.equal(out.cpu(), pattern))}})
if n >= 1:
    host = pattern.pin_memory()
    out, t = timed(lambda: host.to(0, non_blocking=True), [0])
    results.append({{"src": "host", "dst": 0, "gbps": size / t / 1e9,
                     "correct": bool(torch.equal(out.cpu(), pattern))}})
    dev = pattern.to(0)
    back = torch.empty(size, dtype=torch.uint8).pin_memory()
    out, t = timed(lambda: back.copy_(dev, non_blocking=True), [0])
    results.append({{"src": 0, "dst": "host", "gbps": size / t / 1e9, "correct": bool(torch.equal(out, pattern))}})
print(json.dumps(results))
"""


def run_probe(topology: Topology, megabytes: int = 256, repeats: int = 5) -> list[dict[str, Any]]:
    """Measure every pair; annotate each result with its link, the expected floor and a verdict."""
    if not topology.gpus and not topology.names:
        return []
    results = run_in_child(_PROBE.format(size=megabytes * 2**20, repeats=repeats + 1), timeout=600)
    for r in results:
        link = "HOST" if "host" in (r["src"], r["dst"]) else topology.links[r["src"]][r["dst"]]
        floor = FLOOR_GBPS["NV"] * int(link[2:] or 1) if link.startswith("NV") else FLOOR_GBPS.get(link, 1.0)
        r.update(link=link, floor_gbps=floor)
        r["verdict"] = "wrong data" if not r["correct"] else ("slow" if r["gbps"] < floor else "ok")
    return results


def remedy(result: dict[str, Any]) -> str:
    pair = f"{result['src']} -> {result['dst']}"
    if result["verdict"] == "wrong data":
        return (f"GPU copy {pair} returned wrong bytes: peer-to-peer is broken on this machine; set "
                "NCCL_P2P_DISABLE=1 (NCCL then stages through host memory), or train within one island")
    if result["verdict"] == "slow":
        return (f"GPU copy {pair} ran at {result['gbps']:.1f} GB/s, below the {result['floor_gbps']:.0f} GB/s its "
                f"link ({result['link']}) should give: check the PCIe slot width/generation (nvidia-smi -q), "
                "or keep each job within one island (--devices cuda:0,1)")
    return ""
