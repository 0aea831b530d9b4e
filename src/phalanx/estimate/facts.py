"""The model's sizes, read from the model itself: parameters and activations per block, DDP's buckets.

No timing here. DDP's buckets come from torch's own assignment function, applied as DDP applies
it from the second step on (after its "bucket rebuild"): gradients in the order backward produces
them (the last block's first), a bucket closed once it holds ``--bucket-mb`` MiB. phalanx hands
``bucket_cap_mb`` to DDP explicitly, so DDP's smaller first bucket (1 MiB, used only when the cap is
left at torch's default) does not apply.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..pipeline.split import blocks_or_whole
from ..costs import ModelFacts

MIB = 2 ** 20


def ddp_buckets(params_backward_order: Sequence[torch.Tensor], bucket_mb: float) -> list[list[int]]:
    """Indices (into ``params_backward_order``) of every bucket, in the order DDP reduces them."""
    cap = int(bucket_mb * MIB)
    meta = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in params_backward_order]
    indices, _ = dist._compute_bucket_assignment_by_size(meta, [cap, cap], [False] * len(meta))
    return [list(bucket) for bucket in indices]


def model_facts(model: nn.Module, example: torch.Tensor, batch_size: int, bucket_mb: float = 25.0) -> ModelFacts:
    """Sizes of ``model`` for inputs like ``example`` (one or more examples).

    Per block where the model has a sequential structure (what a pipeline splits); a model without
    one (any ``forward`` of a user's own) is one block: every data-parallel cost needs only its
    parameters and buckets, and a pipeline of it is refused where one is asked for.
    """
    named = blocks_or_whole(model)
    blocks = [block for _, block in named]
    block_params = tuple(sum(p.numel() for p in block.parameters() if p.requires_grad) for block in blocks)
    activation = []
    with torch.no_grad():
        x = example[:1]
        for block in blocks:
            x = block(x)
            activation.append(int(x.numel() * x.element_size()))
    # Parameters in the order backward produces their gradients: the last block's first.
    owned = [(b, p) for b, block in enumerate(blocks) for p in block.parameters() if p.requires_grad]
    backward_order = list(reversed(owned))
    buckets = []
    for bucket in ddp_buckets([p for _, p in backward_order], bucket_mb):
        nbytes = sum(backward_order[i][1].numel() * backward_order[i][1].element_size() for i in bucket)
        first_block = min(backward_order[i][0] for i in bucket)
        buckets.append((int(nbytes), first_block))
    element = next((p.element_size() for p in model.parameters()), 4)
    return ModelFacts(tuple(name for name, _ in named), block_params, tuple(activation), tuple(buckets), batch_size,
                      element)
