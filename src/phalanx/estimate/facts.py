"""The model's sizes, read from the model itself: parameters and activations per block, DDP's buckets.

No timing here. DDP's buckets come from torch's own assignment function, applied as DDP applies
it from the second step on (after its "bucket rebuild"): gradients in the order backward produces
them (the last block's first), a bucket closed once it holds ``--bucket-mb`` MiB. phalanx hands
``bucket_cap_mb`` to DDP explicitly, so DDP's smaller first bucket (1 MiB, used only when the cap is
left at torch's default) does not apply.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..costs import ModelFacts
from ..data import batch as batches
from ..strategies.pipeline.split import blocks_or_whole
from ..train.step_checks import first_line_of_failure

MIB = 2 ** 20


def ddp_buckets(params_backward_order: Sequence[torch.Tensor], bucket_mb: float) -> list[list[int]]:
    """Indices (into ``params_backward_order``) of every bucket, in the order DDP reduces them."""
    cap = int(bucket_mb * MIB)
    meta = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in params_backward_order]
    indices, _ = dist._compute_bucket_assignment_by_size(meta, [cap, cap], [False] * len(meta))
    return [list(bucket) for bucket in indices]


def model_facts(model: nn.Module, example: Any, batch_size: int, bucket_mb: float = 25.0,
                step: Optional[Callable] = None) -> ModelFacts:
    """Sizes of ``model`` for batches like ``example`` (a batch tree of one or more examples), called by
    ``step`` (the task's; None: the model called on the inputs, a pair's first element or a tensor alone).

    Per block where the model has a sequential structure (what a pipeline splits); a model without
    one (any ``forward`` of a user's own) is one block: every data-parallel cost needs only its
    parameters and buckets, and a pipeline of it is refused where one is asked for.
    """
    named = blocks_or_whole(model)
    blocks = [block for _, block in named]
    block_params = tuple(sum(p.numel() for p in block.parameters() if p.requires_grad) for block in blocks)
    activation = output_bytes(model, blocks, batches.head(example, 1), step)
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


def output_bytes(model: nn.Module, blocks: list[nn.Module], one: Any, step: Optional[Callable]) -> list[int]:
    """Bytes of every tensor each block outputs for the one-example batch ``one``, the model called by the task's
    step as training calls it (so a dict batch, a model returning (logits, loss), a step of the user's are read as
    they run). Hooks read the outputs, whatever calls the blocks; eval mode: no BatchNorm statistic moves."""
    sizes = [0] * len(blocks)

    def keep(index: int):
        def hook(module, inputs, out):
            sizes[index] = tree_bytes(out)
        return hook

    handles = [block.register_forward_hook(keep(i)) for i, block in enumerate(blocks)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            # no step: the model on the inputs (a pair's first element, or a tensor of inputs alone)
            call = step or (lambda m, b: m(batches.inputs(b)))
            first_line_of_failure(lambda: call(model, one), f"the model fails on an example batch "
                                  f"{batches.describe(one)}", "make it take the batches your data yields, or give "
                                  "--training-step")
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return sizes


def tree_bytes(out: Any) -> int:
    """Bytes of every tensor in an output tree (a tensor, a tuple, a dict, Hugging Face's ``ModelOutput``)."""
    if isinstance(out, Mapping) and type(out) is not dict:
        out = dict(out)  # a ModelOutput is a Mapping that torch's pytree does not open
    return sum(t.numel() * t.element_size() for t in batches.tensors(out))
