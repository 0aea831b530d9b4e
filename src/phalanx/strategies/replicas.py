"""The loud check that every rank starts from the same weights; buffers made one model's again.

DDP would silently overwrite every replica with rank 0's, and ``fully_shard`` keeps each rank's
own slice of its own copy: either way a model built differently on some worker (another seed,
other code) would train a patchwork. Every strategy that starts replicas runs this first:
rank 0's fingerprint is broadcast, every rank compares, and all agree (a MIN all-reduce) before
anyone raises, so every rank fails with the same clear message.

Buffers (BatchNorm's running statistics, its step count) are not parameters: no gradient moves them,
each rank's forward passes update its own. Where a strategy averages the parameters (local SGD,
DiLoCo) :func:`average_buffers` averages them too; where the parameters are equal on every rank
(DDP, FSDP) :func:`broadcast_buffers` gives every rank rank 0's, DDP's own rule. Either way every
rank then holds the one model that is evaluated and saved. :func:`average_over` does the same over a group of
the survivors of a lost worker (``launcher/survivors.py``), never the job's broken one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..errors import PhalanxError
from ..launcher import WorkerContext


def fingerprint(module: nn.Module, chunk: int = 1 << 22) -> torch.Tensor:
    """float64 (sum, sum of squares, position-weighted sum) of every parameter and floating buffer.

    Streamed a chunk at a time on the tensors' own device, so it needs a few MB beside the
    model, never a float64 copy of all of it (a model sharded because it is large must not
    need 8 bytes per parameter again just to be checked).
    """
    tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()]
    total = max(1, sum(t.numel() for t in tensors) - 1)
    out, offset = torch.zeros(3, dtype=torch.float64), 0
    for t in tensors:
        for part in t.detach().reshape(-1).split(chunk):
            d = part.double()
            ramp = torch.arange(offset, offset + len(d), dtype=torch.float64, device=d.device) / total + 1.0
            out += torch.stack([d.sum(), (d * d).sum(), (d * ramp).sum()]).cpu()
            offset += len(d)
    return out


def verify_replicas(module: nn.Module, ctx: WorkerContext) -> None:
    """Fail loudly unless every rank built the same weights (compared through rank 0's fingerprint)."""
    device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")  # NCCL moves CUDA tensors only
    mine = fingerprint(module).to(device)
    reference = mine.clone()
    dist.broadcast(reference, src=0)
    same = torch.tensor([int(torch.allclose(mine, reference, rtol=1e-12, atol=0))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if not same.item():
        raise PhalanxError(f"replicas differ at start (rank {ctx.rank} fingerprint {mine.tolist()} vs rank 0 "
                           f"{reference.tolist()}): build the model identically on every worker (same seed, same code)")


def average_buffers(buffers: list[torch.Tensor]) -> None:
    """Every rank's floating buffers replaced by their mean over the ranks, and its other buffers (integer
    step counts) by rank 0's: one collective per kind, none without buffers. A collective: call it on
    every rank at the same point."""
    floating = [b for b in buffers if b.is_floating_point()]
    others = [b for b in buffers if not b.is_floating_point()]
    for group in _by_dtype(floating):
        flat = _flatten_dense_tensors([b.detach() for b in group])
        dist.all_reduce(flat)
        _write(group, flat / dist.get_world_size())
    _broadcast(others)


def broadcast_buffers(buffers: list[torch.Tensor]) -> None:
    """Every rank's buffers replaced by rank 0's (as DDP does before each forward). A collective."""
    _broadcast(buffers)


def _broadcast(buffers: list[torch.Tensor]) -> None:
    for group in _by_dtype(buffers):
        flat = _flatten_dense_tensors([b.detach() for b in group])
        dist.broadcast(flat, src=0)
        _write(group, flat)


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by dtype and device, in a fixed order (every rank flattens the same groups)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((str(t.dtype), str(t.device)), []).append(t)
    return [groups[key] for key in sorted(groups)]


def _write(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    with torch.no_grad():
        for t, value in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            # One contiguous tensor is flattened as a view of itself (a size-1 dim's odd stride and all:
            # pytorch/examples' ``pe.unsqueeze(0).transpose(0, 1)``): the collective already wrote it in place,
            # and copying its alias back over it is refused as overlapping memory.
            if t.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                t.copy_(value)


def average_over(tensors: list[torch.Tensor], group) -> None:
    """Like :func:`average_buffers`, over ``group``: a process group built outside torch's registry (the
    survivors' of a lost peer, ``launcher/survivors.py``), so called directly, through the CPU (gloo). Floating
    tensors become their mean over it, the others its first rank's. None: one rank alone, nothing to do."""
    if group is None:
        return
    for chunk in _by_dtype(tensors):
        flat = _flatten_dense_tensors([t.detach() for t in chunk]).cpu()
        if flat.is_floating_point():
            group.allreduce([flat]).wait()
            flat /= group.size()
        else:
            group.broadcast(flat, 0).wait()
        _write(chunk, flat.to(chunk[0].device))


def contiguous_buffers(module: nn.Module) -> None:
    """Every buffer laid out as a fresh tensor of its shape would be (a size-1 dim's stride too), in place:
    DDP's coalesced broadcast flattens a buffer that ``is_contiguous()`` into a view of itself and refuses to
    copy it back (overlapping memory), so a model's positional table made by ``transpose`` (pytorch/examples'
    word LM) would crash sync at step 1. A buffer two modules share stays one tensor."""
    done: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is None or buf.stride() == _row_major(buf.shape):
                continue
            if id(buf) not in done:
                done[id(buf)] = buf.clone(memory_format=torch.contiguous_format)
            sub._buffers[name] = done[id(buf)]


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a fresh tensor of this shape (computed: a large buffer is not allocated again to ask)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
