"""Tensor parallelism inside fsdp (``--tensor-parallel N``): DTensor's ``parallelize_module`` is the engine.

The workers form a 2-D mesh (W/N, N) with dims ("shard", "tp"), as torchtitan lays it out: rank r is
tp rank r % N of data group r // N. In every block of the model (fsdp's units), the layers the model declares
(transformers' ``base_model_tp_plan``), else the attention's q, k, v and output projections and an MLP's layers
found by structure (``tp_plan.py``), are split Megatron's way: the first ones column-wise (each tp rank computes
1/N of the heads or hidden units from the whole input), the last row-wise (each rank multiplies its 1/N of the
inputs; one all-reduce over the tp ranks adds the parts). So per block and step: two all-reduces forward, two
backward, over N ranks; nothing else moves.

The N ranks of a tp group compute one replica together, so they read the same data shard: W/N shards a
step. fsdp then shards every parameter over the "shard" dim (N == W: pure tensor parallelism, no fsdp).
Layers outside the blocks (embeddings, the head, norms) are whole on every tp rank and sharded by fsdp.

The plan is worked out in the parent (``tp_plan.py``), refused in one line where it cannot be (a head count, query
or key/value, that N does not divide; projections it cannot tell apart), and printed among the run's plan lines.
A rank holds 1/N of the heads: an attention keeping its head count as an attribute is given its local count
(``tp_styles.localise``); attention code that reshapes by ``-1`` (torchtitan's, transformers') needs nothing.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from ...comm.own_group import own_group
from ...errors import PhalanxError
from ..layout import Job, Layout, Ranks, worker

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
from . import tp_plan


def check_degree(n: int, workers: int) -> None:
    if n > workers or workers % n:
        raise PhalanxError(f"--tensor-parallel {n} does not divide {workers} workers: give a divisor of --workers "
                           f"(each group of {n} ranks splits one replica's layers)")


def layout(job: Job, n: int) -> Layout:
    """Rank r is tp rank r % n of data group r // n; the n ranks of a group read the same shard."""
    workers = job.processes or job.workers
    check_degree(n, workers)
    groups = workers // n
    return Layout(Ranks(workers, functools.partial(worker, n, groups)), tuple(job.devices), groups, True)


def model_plan(model: nn.Module, units: list[tuple[str, nn.Module]], n: int) -> dict[str, dict[str, str]]:
    """{unit name: {submodule name within it: how it is split}} for every unit, or one line why not
    (``tp_plan.py``: what the model declares, else its structure)."""
    return tp_plan.model_plan(model, units, n)


def describe(plan: dict[str, dict[str, str]]) -> str:
    """One line: what every block's plan splits (the blocks share one plan when they are repeats)."""
    plans = {tuple(sorted(p.items())) for p in plan.values()}
    first = next(iter(plan.values()))
    parts = [f"{name} {kind}" for name, kind in first.items()]
    same = "each" if len(plans) == 1 else "e.g. the first"
    return f"{same} of {len(plan)} blocks: " + ", ".join(parts)


def meshes(device_type: str, world_size: int, n: int) -> tuple[Optional[DeviceMesh], Optional[DeviceMesh]]:
    """(the "shard" mesh fsdp shards over, the "tp" mesh): None for a dim of size 1 (nothing to split there)."""
    from torch.distributed.device_mesh import init_device_mesh

    if n == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",)), None
    if n == world_size:
        return None, init_device_mesh(device_type, (n,), mesh_dim_names=("tp",))
    mesh = init_device_mesh(device_type, (world_size // n, n), mesh_dim_names=("shard", "tp"))
    return mesh["shard"], mesh["tp"]


def apply(block: nn.Module, plan: dict[str, str], mesh: DeviceMesh) -> None:
    """torch's ColwiseParallel / RowwiseParallel on the block's planned layers, in place (``tp_styles.py``)."""
    from . import tp_styles  # (imports DTensor: only where a mesh exists)

    tp_styles.apply(block, plan, mesh)


def by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by the mesh they live on (plain tensors together): torch's foreach kernels refuse a mix."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def clip(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """torch's clip_grads_with_norm_ by the whole model's norm, one mesh's parameters at a time."""
    for group in by_mesh(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)


def gradient_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The whole model's gradient norm when its gradients live on different meshes (2-D blocks, 1-D or plain
    embeddings): each mesh's norm over its own ranks (``full_tensor``: one small all-reduce), then combined.
    A plain gradient (pure tensor parallelism: the same on every tp rank) counts once, as it is."""
    from torch.distributed.tensor import DTensor

    norms = []
    for group in by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


#: a model larger than this (elements) is not copied for a rehearsal in the parent (the workers will tell)
REHEARSAL_LIMIT = 1 << 26


def rehearse(model: nn.Module, blocks: Optional[tuple[str, ...]], n: int, example: object, step) -> None:
    """The plan applied to a copy of the model, as rank 0 of N applies it, and a first step (forward, backward)
    on the example batch, in the parent: torch's fake process group (torchtitan's dry run) computes no sums but
    every shape, so a plan that cannot run is one line here, not a worker's traceback. Skipped where a process
    group exists already (torchrun: this process is a worker) or the model is large."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .units import shard_units

    if dist.is_initialized() or sum(p.numel() for p in model.parameters()) > REHEARSAL_LIMIT:
        return
    quiet = logging.root.manager.disable
    logging.disable(max(quiet, logging.ERROR))  # (DTensor logs a failed shape check before raising it)
    try:
        with own_group("fake", store=FakeStore(), rank=0, world_size=n), torch.random.fork_rng():
            twin = copy.deepcopy(model).train()
            units = shard_units(twin, blocks)
            plan = model_plan(twin, units, n)
            mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
            for name, block in units:
                apply(block, plan[name], mesh)
            step(twin, example).loss.backward()
    except PhalanxError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise PhalanxError(f"--tensor-parallel {n}: a first step of {type(model).__name__} with its layers split this "
                           f"way fails ({type(e).__name__}: {first}); its attention must reshape by the local head "
                           "count (view(B, T, -1, head_dim)) or its model declare a tp plan; or drop "
                           "--tensor-parallel") from None
    finally:
        logging.disable(quiet)
