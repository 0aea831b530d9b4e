"""A batch is a tree: a pair ``(inputs, targets)``, a tuple, a dict, or nested containers of tensors.

Whatever the user's data yields is kept as it is and handled as a tree (torch's ``_pytree``, the form
``default_collate`` and Accelerate's ``send_to_device`` work on): its length is the first dimension of
its tensors (all equal), it splits into micro-batches and shards by chunking every tensor on dim 0, it
moves to a device tensor by tensor. The pair of tensors, phalanx's own form, takes a shortcut in the
functions called every step: the loop's bookkeeping must cost nothing over a hand-written loop
(``benchmarks/loop_overhead.py``).

Targets, where a batch has them, follow the conventions users already know: a pair's second element,
a dict's ``labels`` (Hugging Face) or ``label`` (Hugging Face's data sets), or the key ``--target-key``
names. ``-100`` in integer targets is torch's ``ignore_index``: not a class, left out of every count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import default_collate

from ..errors import PhalanxError

#: torch's ``ignore_index`` and Hugging Face's padding label: a position no loss or metric counts.
IGNORE = -100
#: The keys of a dict batch that hold its targets, in the order they are looked for (Hugging Face's names).
TARGET_KEYS = ("labels", "label")


def is_pair(batch: Any) -> bool:
    """``(inputs, targets)``, two tensors: phalanx's own form, and the fast path. Tensors of a subclass count:
    torch.export traces a step on its own tensor types (the pipeline's traced front end)."""
    return type(batch) is tuple and len(batch) == 2 and isinstance(batch[0], torch.Tensor) \
        and isinstance(batch[1], torch.Tensor)


def tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor of the tree, in its order."""
    return [leaf for leaf in pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """The tree with ``fn`` applied to each tensor (other leaves kept as they are)."""
    return pytree.tree_map(lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf, batch)


def length(batch: Any) -> int:
    """Examples in the batch: the first dimension of its tensors, which must all agree."""
    if is_pair(batch):
        return len(batch[0])
    sizes = {len(t) for t in tensors(batch) if t.dim() > 0}
    if len(sizes) != 1:
        raise PhalanxError(f"a batch's tensors must all have the same first dimension (the examples); this one has "
                           f"{sorted(sizes) or 'no tensors'}: {describe(batch)}")
    return sizes.pop()


def split(batch: Any, parts: int) -> list[Any]:
    """The batch in ``parts`` micro-batches (or shards), every tensor chunked on dim 0 as ``Tensor.chunk``
    does (fewer pieces when the batch is shorter than ``parts``); other leaves go to every piece."""
    if parts == 1:
        return [batch]
    if is_pair(batch):
        return list(zip(batch[0].chunk(parts), batch[1].chunk(parts)))
    leaves, spec = pytree.tree_flatten(batch)
    chunked = [leaf.chunk(parts) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else None for leaf in leaves]
    pieces = min(len(c) for c in chunked if c is not None)
    return [pytree.tree_unflatten([leaf if c is None else c[i] for leaf, c in zip(leaves, chunked)], spec)
            for i in range(pieces)]


def head(batch: Any, n: int) -> Any:
    """The first ``n`` examples of the batch."""
    return map_tensors(lambda t: t[:n] if t.dim() > 0 else t, batch)


def gather(columns: Any, idx: torch.Tensor) -> Any:
    """The examples ``idx`` of a data set held as a tree of column tensors: one gather per tensor."""
    if is_pair(columns):
        return columns[0][idx], columns[1][idx]
    return map_tensors(lambda t: t[idx], columns)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    if is_pair(batch):
        return batch[0].to(device, non_blocking=non_blocking), batch[1].to(device, non_blocking=non_blocking)
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)


def to_cpu(tree: Any) -> Any:
    """A copy of the tree with every tensor detached and on the CPU: a checkpoint's state, which loads anywhere,
    or state sent to another rank (``gather_object`` would otherwise unpickle it on the receiver's device)."""
    return map_tensors(lambda t: t.detach().cpu(), tree)


def pin(batch: Any) -> Any:
    """Every tensor in page-locked memory, so a copy to the GPU can overlap the step (``non_blocking``)."""
    return map_tensors(lambda t: t.pin_memory(), batch)


def record_stream(batch: Any, stream: Any) -> None:
    """Tell the caching allocator each tensor is used on ``stream`` (it was copied on another)."""
    for t in tensors(batch):
        t.record_stream(stream)


def nonfinite(batch: Any) -> str:
    """"NaN" or "infinity" when a floating tensor of the batch holds one, else "" (a host read: for after a
    non-finite loss, never an ordinary step)."""
    found = ""
    for t in tensors(batch):
        if torch.is_floating_point(t) and not bool(torch.isfinite(t).all()):
            if bool(torch.isnan(t).any()):
                return "NaN"
            found = "infinity"
    return found


def target_key(batch: Any, key: Optional[str] = None) -> Optional[Any]:
    """Where a batch keeps its targets: 1 for a pair, a dict's key (``key``, else ``labels`` or ``label``);
    None where it has none."""
    if isinstance(batch, Mapping):
        for name in (key,) if key is not None else TARGET_KEYS:
            if name in batch:
                return name
        return None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return 1
    return None


def targets(batch: Any, key: Optional[str] = None) -> Optional[Any]:
    """The batch's targets (see :func:`target_key`), or None."""
    if is_pair(batch):
        return batch[1]
    where = target_key(batch, key)
    return None if where is None else batch[where]


def inputs(batch: Any, key: Optional[str] = None) -> Any:
    """What is not the targets: a pair's first element, a dict without its targets, else the whole batch."""
    where = target_key(batch, key)
    if where is None:
        return batch
    if isinstance(batch, Mapping):
        return {k: v for k, v in batch.items() if k != where}
    return batch[0]


def first_tensor(tree: Any) -> Optional[torch.Tensor]:
    found = tensors(tree)
    return found[0] if found else None


def counted(targets: Any) -> int:
    """How many targets a loss averaged over: integer targets of ``-100`` are left out (``ignore_index``)."""
    if not isinstance(targets, torch.Tensor):
        return 0
    if targets.is_floating_point():
        return targets.numel()
    return int((targets != IGNORE).sum())


def targetless(batch: Any) -> bool:
    """Whether the batch's targets are integers, every one ``-100`` (torch's and Hugging Face's ignore index): its
    loss is a mean over nothing, NaN, and its gradient zero (a host read: for after a non-finite loss)."""
    y = targets(batch)
    return isinstance(y, torch.Tensor) and not y.is_floating_point() and y.numel() > 0 and counted(y) == 0


def collate(items: list, name: str = "the data") -> Any:
    """Items (pairs, tuples, dicts, nested) as one batch tree: torch's ``default_collate``, and every leaf a
    tensor (a string left in an item is a data set not yet tokenized: one line saying so)."""
    try:
        batch = default_collate(items)
    except (RuntimeError, TypeError) as e:
        raise PhalanxError(f"{name}: its items cannot be stacked into a batch ({str(e).splitlines()[0][:160]}); "
                           "give items whose tensors have the same shape in every item") from None
    leaves = pytree.tree_leaves(batch)
    odd = next((leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)), None)
    if odd is not None:
        what = type(odd[0]).__name__ if isinstance(odd, list) and odd else type(odd).__name__
        raise PhalanxError(f"{name}: its items hold a {what} ({describe(items[0])}); phalanx batches tensors and "
                           "numbers: turn it into one (tokenize text first)")
    return batch


def describe(batch: Any) -> str:
    """The tree's shape in a few words: ``{'input_ids': (8, 16) int64, 'labels': (8, 16) int64}``."""
    def one(leaf: Any) -> str:
        if isinstance(leaf, torch.Tensor):
            return f"{tuple(leaf.shape)} {str(leaf.dtype).replace('torch.', '')}"
        return type(leaf).__name__
    if isinstance(batch, Mapping):
        text = "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in batch.items()) + "}"
    elif isinstance(batch, (tuple, list)):
        text = "(" + ", ".join(describe(v) for v in batch) + ")"
    else:
        text = one(batch)
    return text if len(text) <= 200 else text[:197] + "..."
