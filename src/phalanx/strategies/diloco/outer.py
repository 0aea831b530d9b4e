"""DiLoCo's outer round, pure parts: fragments and when each is due, the pseudo-gradient's mean on the wire."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ...errors import PhalanxError
from ..balance import bounds, partition

PRECISIONS = ("fp32", "bf16", "int8")
#: bytes per element of the pseudo-gradient on the wire
WIRE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}


def fragment_bounds(numels: Sequence[int], fragments: int) -> list[tuple[int, int]]:
    """(first, one past the last) parameter tensor of every fragment: contiguous, balanced by size.

    The exact partition the pipeline uses for its stages (the largest fragment as small as it can be).
    """
    if fragments > len(numels):
        raise PhalanxError(f"--fragments {fragments} but the model has only {len(numels)} parameter tensors: every "
                           f"fragment needs at least one; use --fragments {len(numels)} or fewer")
    return bounds(partition([float(n) for n in numels], fragments))


def fragment_offsets(sync_every: int, fragments: int) -> tuple[int, ...]:
    """The step index at which each fragment first syncs: spread evenly over H."""
    return tuple(f * sync_every // fragments for f in range(fragments))


def due(index: int, sync_every: int, offsets: Sequence[int]) -> list[int]:
    """The fragments that sync after the step of 0-based ``index``: ``(index - offset) % H == 0``."""
    return [f for f, offset in enumerate(offsets) if index >= offset and (index - offset) % sync_every == 0]


def quantize_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and the per-tensor fp32 scale (max-abs / 127): ``t ~= q * scale``."""
    scale = t.detach().abs().max().float() / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero tensor: any scale is exact
    q = torch.round(t.float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def average(tensors: list[torch.Tensor], precision: str, world_size: int, distributed: bool) -> list[torch.Tensor]:
    """The mean over every rank of each fp32 tensor, sent as ``precision``; fp32 results, equal on every rank.

    - fp32: one all-reduce (SUM) of the flattened tensors.
    - bf16: cast, divide by the world size first, one all-reduce in bf16 (as torch's
      ``bf16_compress_hook`` for DDP does), then back to fp32: half the bytes of fp32 at any world size.
    - int8: each rank quantizes each tensor with its own scale (max-abs / 127) and the ranks
      *all-gather* the int8 values and the scales; every rank dequantizes and sums in fp32 in rank
      order, so every rank gets the same mean. Not an all-reduce: an int8 sum of W workers overflows,
      and summing in int32 or fp32 would put 4 bytes per element on the wire, no fewer than fp32.
      The gather sends (W-1)·n bytes per rank against (W-1)/W·8n for a ring all-reduce of fp32:
      4x fewer at 2 workers, 2x at 4, even at 8 (beyond 8 workers use bf16).
    With one process nothing is sent, but the values still go through the cast or the quantization.
    """
    if precision == "int8":
        return _average_int8(tensors, world_size, distributed)
    flat = _flatten_dense_tensors(tensors)
    if precision == "bf16":
        flat = (flat / world_size).to(torch.bfloat16)
        if distributed:
            dist.all_reduce(flat)
        flat = flat.float()
    else:
        if distributed:
            dist.all_reduce(flat)
        flat = flat / world_size
    return list(_unflatten_dense_tensors(flat, tensors))


def _average_int8(tensors: list[torch.Tensor], world_size: int, distributed: bool) -> list[torch.Tensor]:
    pairs = [quantize_int8(t) for t in tensors]
    q = _flatten_dense_tensors([p[0] for p in pairs])
    scales = torch.stack([p[1] for p in pairs])
    if distributed:
        every_q, every_scales = [torch.empty_like(q) for _ in range(world_size)], \
            [torch.empty_like(scales) for _ in range(world_size)]
        dist.all_gather(every_q, q)
        dist.all_gather(every_scales, scales)
    else:
        every_q, every_scales = [q], [scales]
    total = [torch.zeros_like(t, dtype=torch.float32) for t in tensors]
    for rank_q, rank_scales in zip(every_q, every_scales):  # rank order: the same sum on every rank
        for i, values in enumerate(_unflatten_dense_tensors(rank_q, tensors)):
            total[i] += dequantize_int8(values, rank_scales[i])
    return [t / world_size for t in total]


def wire_bytes(numels: Iterable[int], precision: str) -> int:
    """What one rank puts on the wire for these tensors' pseudo-gradient (int8: plus a 4-byte scale each)."""
    numels = list(numels)
    return sum(numels) * WIRE_BYTES[precision] + (4 * len(numels) if precision == "int8" else 0)
