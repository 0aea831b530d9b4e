"""Tensor parallelism inside fsdp (``--tensor-parallel N``): DTensor's ``parallelize_module`` is the engine.

The workers form a 2-D mesh (W/N, N) with dims ("shard", "tp"), as torchtitan lays it out: rank r is
tp rank r % N of data group r // N. In every block of the model (fsdp's units), each module whose
``nn.Linear`` children are projections out of the block's width followed by one back into it (an
attention's q, k, v and output projection; an MLP's two layers) is split Megatron's way: the first ones
column-wise (each tp rank computes 1/N of the heads or hidden units from the whole input), the last
row-wise (each rank multiplies its 1/N of the inputs; one all-reduce over the tp ranks adds the parts).
So per block and step: two all-reduces forward, two backward, over N ranks; nothing else moves.

The N ranks of a tp group compute one replica together, so they read the same data shard: W/N shards a
step. fsdp then shards every parameter over the "shard" dim (N == W: pure tensor parallelism, no fsdp).
Layers outside the blocks (embeddings, the head, norms) are whole on every tp rank and sharded by fsdp.

The plan is worked out in the parent from the model's structure (:func:`block_plan`), refused in one
line where it cannot be (a head count that N does not divide, a layer that is not ``nn.Linear``), and
printed among the run's plan lines. Attention code must reshape with the local head count
(``view(B, T, -1, head_dim)``, torchtitan's form), since a rank holds n_head / N heads.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ...errors import PhalanxError
from ..layout import Job, Layout, RankPlan, Role

#: where a module keeps its head count, in the conventions of nanoGPT, torch and Hugging Face
HEAD_ATTRIBUTES = ("n_head", "num_heads", "n_heads", "num_attention_heads")
COLWISE, ROWWISE = "column-wise", "row-wise"


def check_degree(n: int, workers: int) -> None:
    if n > workers or workers % n:
        raise PhalanxError(f"--tensor-parallel {n} does not divide {workers} workers: give a divisor of --workers "
                           f"(each group of {n} ranks splits one replica's layers)")


def layout(job: Job, n: int) -> Layout:
    """Rank r is tp rank r % n of data group r // n; the n ranks of a group read the same shard."""
    workers = job.processes or job.workers
    check_degree(n, workers)
    groups = workers // n
    ranks = tuple(RankPlan(Role.WORKER, f"worker {r}", r // n, (r // n, groups)) for r in range(workers))
    return Layout(ranks, tuple(job.devices), groups, True)


def model_plan(units: list[tuple[str, nn.Module]], n: int) -> dict[str, dict[str, str]]:
    """{unit name: {submodule name within it: COLWISE or ROWWISE}} for every unit, or one line why not."""
    return {name: block_plan(unit, n, name) for name, unit in units}


def block_plan(block: nn.Module, n: int, where: str) -> dict[str, str]:
    """The split of one block: every module holding paired ``nn.Linear`` children (see the module's docstring)."""
    plan: dict[str, str] = {}
    for name, module in block.named_modules():
        linears = [(child, m) for child, m in module.named_children() if isinstance(m, nn.Linear)]
        if len(linears) < 2:
            continue
        path = f"{where}.{name}" if name else where
        _check_pairs(linears, path, n)
        if len(linears) > 2:  # q, k, v (or more) and an output projection: attention, split by heads
            _check_heads(module, path, n)
        prefix = f"{name}." if name else ""
        plan.update({prefix + child: COLWISE for child, _ in linears[:-1]})
        plan[prefix + linears[-1][0]] = ROWWISE
    if not plan:
        kinds = sorted({type(m).__name__ for m in block.modules()
                        if any(True for _ in m.parameters(recurse=False))})
        raise PhalanxError(f"--tensor-parallel: block '{where}' has no module holding nn.Linear projections to split "
                           f"(its layers with weights: {', '.join(kinds) or 'none'}); tensor parallelism splits "
                           "nn.Linear layers (transformers' GPT-2 Conv1D is not one): drop --tensor-parallel")
    return plan


def _check_pairs(linears: list[tuple[str, nn.Linear]], path: str, n: int) -> None:
    *firsts, (_, last) = linears
    paired = all(m.in_features == last.out_features and m.out_features == last.in_features for _, m in firsts)
    if not paired:
        shapes = ", ".join(f"{c} {m.in_features}->{m.out_features}" for c, m in linears)
        raise PhalanxError(f"--tensor-parallel: '{path}' holds Linear layers ({shapes}) that are not projections out "
                           "of one width and one back (a fused q,k,v split in forward cannot be split by columns): "
                           "give it separate projections, or drop --tensor-parallel")
    for child, m in linears:
        width = m.out_features if (child, m) != linears[-1] else m.in_features
        if width % n:
            raise PhalanxError(f"--tensor-parallel {n}: '{path}.{child}' has {width} features to split, not divisible "
                               f"by {n}; give a --tensor-parallel that divides {width}")


def _check_heads(module: nn.Module, path: str, n: int) -> None:
    heads = next((getattr(module, a) for a in HEAD_ATTRIBUTES if isinstance(getattr(module, a, None), int)), None)
    if heads is None:
        raise PhalanxError(f"--tensor-parallel: cannot tell how many heads '{path}' ({type(module).__name__}) has (no "
                           f"{' / '.join(HEAD_ATTRIBUTES)} attribute); its q, k, v are split by whole heads: give it one")
    if heads % n:
        raise PhalanxError(f"--tensor-parallel {n}: '{path}' has {heads} heads, which do not split between {n} ranks; "
                           f"give a --tensor-parallel that divides {heads}")


def describe(plan: dict[str, dict[str, str]]) -> str:
    """One line: what every block's plan splits (the blocks share one plan when they are repeats)."""
    plans = {tuple(sorted(p.items())) for p in plan.values()}
    first = next(iter(plan.values()))
    parts = [f"{name} {kind}" for name, kind in first.items()]
    same = "each" if len(plans) == 1 else "e.g. the first"
    return f"{same} of {len(plan)} blocks: " + ", ".join(parts)


def meshes(device_type: str, world_size: int, n: int) -> tuple[Optional[object], Optional[object]]:
    """(the "shard" mesh fsdp shards over, the "tp" mesh): None for a dim of size 1 (nothing to split there)."""
    from torch.distributed.device_mesh import init_device_mesh

    if n == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",)), None
    if n == world_size:
        return None, init_device_mesh(device_type, (n,), mesh_dim_names=("tp",))
    mesh = init_device_mesh(device_type, (world_size // n, n), mesh_dim_names=("shard", "tp"))
    return mesh["shard"], mesh["tp"]


def apply(block: nn.Module, plan: dict[str, str], mesh: object) -> None:
    """torch's ColwiseParallel / RowwiseParallel on the block's planned layers, in place."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}
    parallelize_module(block, mesh, {name: styles[kind]() for name, kind in plan.items()})


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
