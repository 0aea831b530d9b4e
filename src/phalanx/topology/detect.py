"""Find out what this machine has, without initialising CUDA in the calling process.

GPU links come from ``nvidia-smi topo -m``; peer access from ``torch.cuda.can_device_access_peer``
run in a *child* process (a parent that has initialised CUDA can no longer fork workers safely,
and a user's launcher may not want a CUDA context there). The CPU side (sockets, NUMA nodes,
cores) comes from ``/sys``.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from typing import Any, Optional

from .model import CpuInfo, Topology

_TIMEOUT_S = 60


def run_in_child(code: str, timeout: float = _TIMEOUT_S) -> Any:
    """Run Python ``code`` (which prints one JSON value last) in a fresh interpreter; return it."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "child failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


_CUDA_QUERY = """
import json, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
names = [torch.cuda.get_device_name(i) for i in range(n)]
peer = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]
print(json.dumps({"names": names, "peer": peer}))
"""


def _nvidia_smi(*args: str) -> Optional[str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def cpu_info() -> CpuInfo:
    cpus = glob.glob("/sys/devices/system/cpu/cpu[0-9]*")
    packages, cores = set(), set()
    for cpu in cpus:
        package = _read(f"{cpu}/topology/physical_package_id")
        core = _read(f"{cpu}/topology/core_id")
        if package is not None:
            packages.add(package)
            cores.add((package, core))
    nodes = len(glob.glob("/sys/devices/system/node/node[0-9]*")) or 1
    threads = len(cpus) or os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = threads
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return CpuInfo(len(packages) or 1, nodes, len(cores) or threads, threads, usable, model)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def detect_topology(peer: bool = True) -> Topology:
    """This machine's GPUs (links, peer access, affinity) and CPU."""
    text = _nvidia_smi("topo", "-m")
    query = None
    if peer or text is None:
        try:
            query = run_in_child(_CUDA_QUERY)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError):
            query = None
    if text is not None:
        topo = Topology.from_nvidia_smi(text, source="nvidia-smi topo -m")
        if query and len(query["peer"]) == len(topo.gpus):
            topo.peer = query["peer"]
            topo.source += " + torch.cuda.can_device_access_peer"
    elif query and query["names"]:
        topo = Topology.from_peer_matrix(query["peer"], source="torch.cuda.can_device_access_peer")
    else:
        topo = Topology(source="no CUDA devices")
    if query:
        topo.names = query["names"]
    topo.cpu = cpu_info()
    return topo
