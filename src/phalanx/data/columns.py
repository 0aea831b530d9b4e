"""A data set of any item structure held in memory as a tree of column tensors.

Items that are dicts, tuples or nested containers (``{"input_ids": ..., "labels": ...}``, ``(image, feats,
label)``) are collated once, with torch's ``default_collate``, into one tree whose every tensor holds a column
(first dimension: the examples); a dict of equal-length tensors, as a tokenizer returns it, already is one. A
batch is then one gather per tensor, as a pair's is in :class:`~phalanx.data.datasets.ArrayDataset`, and it has
the same interface (``take``, ``read``, ``subset``, ``cast``, and what the checks read), so the sharding, resume
and data position are the same code for every form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Iterable, Iterator, Optional

import torch

from ..errors import PhalanxError
from . import batch as batches


@dataclasses.dataclass
class Columns:
    """Examples as a tree of tensors sharing their first dimension; ``target_key``: where a dict keeps its
    targets (None: ``labels`` or ``label``)."""

    tree: Any
    target_key: Optional[str] = None
    name: str = "the data"
    augment_params = None  #: no built-in augmentation: the user's data comes as it is

    def __post_init__(self) -> None:
        self.size = batches.length(self.tree)  # (one line where the columns' lengths differ)
        if self.size == 0:
            raise PhalanxError(f"{self.name} is empty: give at least one example")
        y = self.targets
        if y is not None:
            check_targets(y, self.name)
            if not y.is_floating_point():
                self.tree = self._with_targets(y.long())

    def __len__(self) -> int:
        return self.size

    @property
    def targets(self) -> Optional[torch.Tensor]:
        y = batches.targets(self.tree, self.target_key)
        return y if isinstance(y, torch.Tensor) else None

    def _with_targets(self, y: torch.Tensor) -> Any:
        where = batches.target_key(self.tree, self.target_key)
        if isinstance(self.tree, Mapping):
            return {**self.tree, where: y}
        return type(self.tree)([y if i == where else v for i, v in enumerate(self.tree)])

    # What the readers and checks use, the same as an ArrayDataset's.
    @property
    def _input(self) -> Optional[torch.Tensor]:
        return batches.first_tensor(batches.inputs(self.tree, self.target_key))

    @property
    def example_shape(self) -> tuple[int, ...]:
        x = self._input
        return tuple(x.shape[1:]) if x is not None else ()

    @property
    def input_dtype(self) -> torch.dtype:
        floats = [t for t in batches.tensors(batches.inputs(self.tree, self.target_key)) if t.is_floating_point()]
        x = floats[0] if floats else self._input
        return x.dtype if x is not None else torch.float32

    @property
    def target_dtype(self) -> torch.dtype:
        y = self.targets
        return y.dtype if y is not None else torch.long

    @property
    def target_shape(self) -> tuple[int, ...]:
        y = self.targets
        return tuple(y.shape[1:]) if y is not None else ()

    def largest_target(self) -> int:
        y = self.targets
        return int(y.max()) if y is not None and y.numel() else 0

    def take(self, idx: torch.Tensor, params: Optional[torch.Tensor] = None) -> Any:
        return batches.gather(self.tree, idx)

    def read(self, plan: Iterable[tuple[torch.Tensor, Optional[torch.Tensor]]]) -> Iterator[Any]:
        return (batches.gather(self.tree, idx) for idx, _ in plan)

    def subset(self, idx: torch.Tensor) -> "Columns":
        return dataclasses.replace(self, tree=batches.gather(self.tree, idx))

    def cast(self, inputs: Optional[torch.dtype] = None, targets: Optional[torch.dtype] = None) -> "Columns":
        """Floating inputs to ``inputs``, floating targets to ``targets`` (integer columns, token ids and masks,
        stay as they are)."""
        y = self.targets
        def to(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
            return t.to(dtype) if dtype is not None and t.is_floating_point() else t
        tree = batches.map_tensors(lambda t: t if t is y else to(t, inputs), self.tree)
        cast = dataclasses.replace(self, tree=tree)
        if y is not None and targets is not None and y.is_floating_point():
            cast.tree = cast._with_targets(y.to(targets))
        return cast


def check_targets(y: torch.Tensor, name: str) -> None:
    """Integer targets are class indices 0..C-1, or ``-100`` (torch's ignore_index: a padding position);
    floats are regression targets."""
    if y.is_complex() or y.dtype == torch.bool:
        raise PhalanxError(f"{name}: targets are {str(y.dtype).replace('torch.', '')}: give integer class indices "
                           "or float regression targets")
    if y.is_floating_point() or not y.numel():
        return
    real = y[y != batches.IGNORE]
    if real.numel() and int(real.min()) < 0:
        raise PhalanxError(f"{name}: integer targets are class indices 0..C-1 (or -100 for a position no loss "
                           f"counts), and {int(real.min())} is neither; for regression give float targets (y.float())")
