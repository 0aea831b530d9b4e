"""The user's data as an in-memory :class:`ArrayDataset` pair: tensors, numpy arrays, any map-style Dataset.

Targets are class indices (a classifier), one per example or one per position (a sequence model),
or floats (regression: :class:`Examples` keeps them; the built-in sets' ArrayDataset wants labels).

Sharding is by index (deterministic per epoch, exact resume), so a dataset must be indexable: an
``IterableDataset`` is refused. A general ``Dataset`` is materialised here into two tensors, one
``dataset[i]`` at a time: fine for the sizes a CPU job trains on, and it keeps the fast path (one
gather per batch). With ``--loader-workers N`` it is left lazy instead, read a batch at a time by N
DataLoader worker processes per rank (``lazy.py``): for data that loads from disk, or does not fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from ..errors import PhalanxError
from .datasets import ArrayDataset, DataBundle, ExampleSet
from .batch import IGNORE, collate
from .columns import Columns, check_targets
from .lazy import LazyExamples, as_tensor, read_item

#: The fraction held out for validation when no test set is given.
DEFAULT_VALIDATION_SPLIT = 0.1


class Examples(ArrayDataset):
    """The user's examples: integer targets are class indices (any shape: one per example, or one per
    position), float targets are regression targets, kept as they are."""

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise PhalanxError(f"data set has {len(self.x)} inputs but {len(self.y)} targets")
        if self.y.is_complex() or self.y.dtype == torch.bool:
            raise PhalanxError(f"targets are {str(self.y.dtype).replace('torch.', '')}: give integer class indices "
                               "or float regression targets")
        if not self.y.is_floating_point():
            check_targets(self.y, "the data")  # class indices, or -100: a position no loss counts
            self.y = self.y.long()


def regression(data: ExampleSet) -> bool:
    """Float targets: a regression (MSE by default), not a classifier."""
    return data.target_dtype.is_floating_point


def as_arrays(value: Any, name: str, loader_workers: int = 0, target_key: Optional[str] = None) -> ExampleSet:
    """One set of examples in memory: (input, target) pairs as an ArrayDataset, items of any other structure as
    :class:`Columns` (a general Dataset with ``loader_workers``: left lazy, see ``lazy.py``), or one line saying
    what it should be."""
    if isinstance(value, (ArrayDataset, LazyExamples, Columns)):
        return value
    if isinstance(value, Mapping):  # a dict of equal-length columns, as a tokenizer returns it
        return Columns({k: as_tensor(v, f"{name}[{k!r}]") for k, v in value.items()}, target_key, name)
    if isinstance(value, IterableDataset):
        raise PhalanxError(f"{name} is an IterableDataset ({type(value).__name__}): phalanx shards data by index, "
                           "so that every epoch's order is deterministic and a resume exact; give a map-style "
                           "Dataset (__len__ and __getitem__) or tensors")
    if isinstance(value, TensorDataset):
        return _pair(value.tensors, name) if len(value.tensors) == 2 else Columns(tuple(value.tensors), None, name)
    if isinstance(value, (tuple, list)) and len(value) == 2 and not isinstance(value[0], (tuple, list, Mapping)):
        return _pair(value, name)
    plain = isinstance(value, (torch.Tensor, np.ndarray))  # inputs alone: the targets are missing
    if not plain and (isinstance(value, Dataset) or (hasattr(value, "__getitem__") and hasattr(value, "__len__"))):
        if loader_workers:
            lazy = LazyExamples(value, loader_workers, name, target_key=target_key)
            lazy.check_sendable()
            return lazy
        return _materialise(value, name, target_key)
    raise PhalanxError(f"{name} must be a pair (inputs, targets) of tensors or numpy arrays, a dict of equal-length "
                       f"tensors, or a map-style torch Dataset (items: pairs, tuples or dicts of tensors); got "
                       f"{type(value).__name__}")


def _pair_item(item: Any) -> bool:
    """(input, target), two arrays or numbers: stacked into the fast pair form."""
    return isinstance(item, (tuple, list)) and len(item) == 2 and \
        not any(isinstance(v, (tuple, list, Mapping)) for v in item)


def _pair(value: Any, name: str) -> ArrayDataset:
    x, y = (as_tensor(v, name) for v in value)
    if len(y) == 0:
        raise PhalanxError(f"{name} is empty: give at least one example")
    return Examples(x, y)


def _materialise(dataset: Any, name: str, target_key: Optional[str] = None) -> Any:
    """Every item of a map-style dataset, stacked (small data: see the module docstring): pairs into an
    ArrayDataset, items of any other structure collated into :class:`Columns`."""
    n = len(dataset)
    if n == 0:
        raise PhalanxError(f"{name} is empty: give at least one example")
    first = read_item(dataset, 0, name)
    items = [first] + [read_item(dataset, i, name) for i in range(1, n)]
    if not _pair_item(first):
        return Columns(collate(items, name), target_key, name)
    odd = next((i for i, item in enumerate(items) if not _pair_item(item)), None)
    if odd is not None:
        raise PhalanxError(f"{name}[{odd}] is a {type(items[odd]).__name__} where {name}[0] is an (input, target) "
                           "pair: give every example the same structure")
    try:
        x = torch.stack([as_tensor(item[0], name) for item in items])
        y = torch.stack([as_tensor(item[1], name) for item in items])
    except RuntimeError as e:
        raise PhalanxError(f"{name}: items must all have the same shape ({str(e).splitlines()[0][:120]})") from None
    return Examples(x, y)


def user_bundle(train: Any, test: Any, validation_split: Optional[float] = None, seed: int = 0,
                name: str = "your data", source: Optional[str] = None, loader_workers: int = 0,
                target_key: Optional[str] = None) -> DataBundle:
    """The user's train and test sets; without a test set, a fixed (seeded) ``validation_split`` held out.
    ``source``: where they came from, in messages (``--data mymod:load``; None: the API's arguments)."""
    train_name, test_name = (f"{source}: its train set", f"{source}: its test set") if source \
        else ("train_data", "test_data")
    if train is None:
        raise PhalanxError("test_data was given without train_data: give both, or neither for a built-in set")
    train_ds = as_arrays(train, train_name, loader_workers, target_key)
    if loader_workers and not isinstance(train_ds, LazyExamples):
        raise PhalanxError(f"--loader-workers {loader_workers} reads a map-style Dataset lazily, and {train_name} "
                           f"is in memory already ({type(train).__name__}); drop --loader-workers")
    if test is not None:
        if validation_split is not None:
            raise PhalanxError("--validation-split holds out part of the training data when there is no test set, "
                               "and this data has one; drop --validation-split")
        test_ds, held_out = as_arrays(test, test_name, loader_workers, target_key), "test"
        classes = _outputs(train_ds, test_ds, train_name, test_name)
    else:
        classes = _outputs(train_ds, train_ds, train_name, train_name)  # before the split: one pass over a lazy set
        train_ds, test_ds = _split(train_ds, DEFAULT_VALIDATION_SPLIT if validation_split is None
                                   else validation_split, seed)
        held_out = "validation"
    if test_ds.example_shape != train_ds.example_shape:
        raise PhalanxError(f"test_data examples have shape {test_ds.example_shape} but train_data examples "
                           f"{train_ds.example_shape}: give both sets the same example shape")
    if regression(train_ds) != regression(test_ds):
        raise PhalanxError(f"train targets are {str(train_ds.target_dtype).replace('torch.', '')} but test targets "
                           f"{str(test_ds.target_dtype).replace('torch.', '')}: give both float (regression) or both "
                           "integer (classes)")
    return DataBundle(name, train_ds, test_ds, train_ds.example_shape, classes, held_out=held_out)


def _outputs(train: ExampleSet, test: ExampleSet, train_name: str, test_name: str) -> int:
    """What ``num_classes`` tells a model factory: the classes, or for regression the values per example."""
    if regression(train):
        return max(1, int(torch.tensor(train.target_shape).prod()))
    largest = [_largest_counted(train, train_name)] + ([] if test is train else [_largest_counted(test, test_name)])
    return max(max(largest) + 1, 2)


def _largest_counted(data: ExampleSet, name: str) -> int:
    """The largest class index; every target -100 (-100 is the one negative allowed: the largest is -100 only
    then) leaves no loss to take: a mean over no targets is nan, which read as a divergence at step 1."""
    largest = data.largest_target()
    if largest == IGNORE:
        raise PhalanxError(f"{name}: every target is -100 (torch's ignore_index, a position no loss counts), so "
                           "there is no loss to take; give the labels, marking only padding -100")
    return largest


def _split(data: ExampleSet, fraction: float, seed: int) -> tuple[ExampleSet, ExampleSet]:
    """A fixed part held out: the same examples on every run with this seed, whatever the workers."""
    n_out = int(round(len(data) * fraction))
    if not 1 <= n_out < len(data):
        raise PhalanxError(f"--validation-split {fraction:g} of {len(data)} examples holds out {n_out}; choose a "
                           "fraction that leaves at least one example on each side (0.1 is usual)")
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    return data.subset(order[n_out:]), data.subset(order[:n_out])


def cast_to_model(bundle: DataBundle, model: torch.nn.Module) -> DataBundle:
    """:func:`cast_inputs` to ``model``'s parameter dtype: its first floating parameter's (float32 if none)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return cast_inputs(bundle, dtype)


def cast_inputs(bundle: DataBundle, dtype: torch.dtype) -> DataBundle:
    """Floating inputs (and regression targets) in the model's parameter dtype (scikit-learn gives float64),
    said once in the header."""
    notes = []
    for part in ("inputs", "targets"):
        have = bundle.train.input_dtype if part == "inputs" else bundle.train.target_dtype
        if not have.is_floating_point or have == dtype:
            continue
        for name in ("train", "test"):
            setattr(bundle, name, getattr(bundle, name).cast(**{part: dtype}))
        notes.append(f"{part} {str(have).replace('torch.', '')} cast to {str(dtype).replace('torch.', '')} "
                     "(the model's parameter dtype)")
    bundle.notes = bundle.notes + tuple(notes)
    return bundle
