"""Which launcher started us: ``torchrun``, Slurm's ``srun``, or nobody (phalanx spawns its own workers).

Pure reading of the environment, so every rule here is tested without processes:

- **torchrun** (or any launcher that sets ``RANK`` and ``WORLD_SIZE``): this process is rank
  ``RANK`` of ``WORLD_SIZE`` and joins through ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``).
- **Slurm** (``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURM_LOCALID`` set, no torchrun variables):
  this process is task ``SLURM_PROCID`` of the step's tasks (``SLURM_STEP_NUM_TASKS``, else
  ``SLURM_NTASKS``), local rank ``SLURM_LOCALID``. Every task rendezvouses on
  ``MASTER_ADDR`` if set, else on the first host of ``SLURM_JOB_NODELIST`` (the compressed host
  list expanded: ``node[01-03,07],gpu5`` -> ``node01``), at ``MASTER_PORT`` if set, else at
  :data:`SLURM_DEFAULT_PORT` plus the job id modulo 1000 (so two jobs that share a node do not
  collide). Rank 0 hosts the rendezvous store there. A CPU worker takes ``SLURM_CPUS_PER_TASK`` torch
  threads where Slurm sets it (the task is already bound to that many cores), else its share of
  this node's cores: the cores divided by the tasks on this node (the tasks-per-node list,
  ``SLURM_NTASKS_PER_NODE``, else the tasks spread over ``SLURM_NNODES``).

Under Slurm, start phalanx with ``srun`` (one task per worker). A batch script that runs
``phalanx train`` itself, without ``srun``, also has ``SLURM_PROCID=0`` and ``SLURM_NTASKS=N``,
and would wait for N - 1 tasks that never start (until ``--timeout``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping, Optional

from ..errors import PhalanxError

#: Where a Slurm job rendezvouses when MASTER_PORT is not set: torch's usual port (torchrun's
#: default ``--master-port``) plus SLURM_JOB_ID mod 1000.
SLURM_DEFAULT_PORT = 29500

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE")
SLURM_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


@dataclasses.dataclass(frozen=True)
class Joined:
    """A job another launcher started; this process is one of its workers."""

    launcher: str  #: "torchrun" or "slurm"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: Optional[int]  #: workers on this machine (None: the launcher does not say)
    init_method: str  #: how to join the process group: "env://" or "tcp://HOST:PORT"
    #: torch threads for a CPU worker where the launcher says (Slurm's --cpus-per-task); None: a share of the cores
    threads: Optional[int] = None


def joined(environ: Optional[Mapping[str, str]] = None) -> Optional[Joined]:
    """The launcher that started this process, read from ``environ`` (default: os.environ); None: none did."""
    env = os.environ if environ is None else environ
    if all(name in env for name in TORCHRUN_VARIABLES):
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else None
        return _checked(Joined("torchrun", rank, world, local, local_world, "env://"))
    if all(name in env for name in SLURM_VARIABLES):
        return _checked(_slurm(env))
    return None


def _slurm(env: Mapping[str, str]) -> Joined:
    world_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    addr = env.get("MASTER_ADDR") or _first_host(env)
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else slurm_default_port(env.get("SLURM_JOB_ID"))
    threads = _int(env, "SLURM_CPUS_PER_TASK") if env.get("SLURM_CPUS_PER_TASK") else None
    return Joined("slurm", _int(env, "SLURM_PROCID"), _int(env, world_name), _int(env, "SLURM_LOCALID"),
                  _slurm_local_world(env), f"tcp://{_bracketed(addr)}:{port}", threads)


def _first_host(env: Mapping[str, str]) -> str:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise PhalanxError("started by Slurm (SLURM_PROCID is set) but neither MASTER_ADDR nor SLURM_JOB_NODELIST "
                           "says where to rendezvous; export MASTER_ADDR=<first node> in the batch script")
    return expand_hostlist(nodelist)[0]


def _slurm_local_world(env: Mapping[str, str]) -> int:
    """Tasks on this node: this node's entry of the tasks-per-node list, else SLURM_NTASKS_PER_NODE,
    else the tasks spread evenly over the nodes (SLURM_NNODES), else every task (one node).

    Never unknown: CPU tasks split this node's cores by it, and a task that took every core would
    fight the others for them (many times slower: benchmarks/README.md, "Figures behind the code").
    """
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = expand_tasks_per_node(env[name])
            node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
            if 0 <= node < len(counts):
                return counts[node]
    if env.get("SLURM_NTASKS_PER_NODE"):
        return _int(env, "SLURM_NTASKS_PER_NODE")
    world_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    nodes_name = next((n for n in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") if env.get(n)), None)
    nodes = max(1, _int(env, nodes_name)) if nodes_name else 1
    return -(-_int(env, world_name) // nodes)


def slurm_default_port(job_id: Optional[str]) -> int:
    """:data:`SLURM_DEFAULT_PORT` + job id mod 1000 (just the base port without a job id)."""
    return SLURM_DEFAULT_PORT + (int(job_id) % 1000 if job_id and job_id.isdigit() else 0)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 address in a URL


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise PhalanxError(f"{name}={env[name]!r} in the environment is not a whole number; the launcher that "
                           "started phalanx set it wrongly") from None


def _checked(job: Joined) -> Joined:
    if job.world_size < 1 or not 0 <= job.rank < job.world_size or job.local_rank < 0:
        raise PhalanxError(f"{job.launcher} says rank {job.rank} of {job.world_size} (local rank {job.local_rank}): "
                           "the rank must be in 0..world size - 1; check the launcher's variables")
    return job


# --------------------------------------------------------------------------- Slurm's compressed lists

_GROUP = re.compile(r"\[([^\[\]]*)\]")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded in order: ``node[01-03,07],gpu5`` -> node01, node02, node03, node07, gpu5.

    Ranges keep their zero padding (``[08-10]`` -> 08, 09, 10); several bracket groups in one name
    expand as a product (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2), as ``scontrol show hostnames`` does.
    """
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        hosts.extend(_expand_item(item, text))
    if not hosts:
        raise PhalanxError(f"host list {text!r} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on the commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth < 0 or depth > 1:
            raise PhalanxError(f"host list {text!r} has unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise PhalanxError(f"host list {text!r} has unbalanced brackets")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str, whole: str) -> list[str]:
    match = _GROUP.search(item)
    if match is None:
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    return [head + choice + rest for choice in _expand_ranges(match.group(1), whole)
            for rest in _expand_item(tail, whole)]


def _expand_ranges(spec: str, whole: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise PhalanxError(f"host list {whole!r}: [{spec}] is not numbers and ranges like [01-03,07]")
        if not high:
            out.append(low)
            continue
        if int(high) < int(low):
            raise PhalanxError(f"host list {whole!r}: range {part} runs backwards")
        width = len(low) if low.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks-per-node list, one entry per node: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise PhalanxError(f"tasks per node {text!r} is not like '2(x3),1'")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
