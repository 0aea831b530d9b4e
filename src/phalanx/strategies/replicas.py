"""The loud check that every rank starts from the same weights.

DDP would silently overwrite every replica with rank 0's, and ``fully_shard`` keeps each rank's
own slice of its own copy: either way a model built differently on some worker (another seed,
other code) would train a patchwork. Every strategy that starts replicas runs this first:
rank 0's fingerprint is broadcast, every rank compares, and all agree (a MIN all-reduce) before
anyone raises, so every rank fails with the same clear message.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

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
