"""Data sets held in memory: scikit-learn's digits, CIFAR-10 from its binary files, synthetic.

A data set here is a pair of :class:`ArrayDataset` (train, test). Examples are stored raw
(uint8 pixels for CIFAR-10) and turned into model inputs one batch at a time by a transform,
so augmentation draws fresh crops and flips every epoch without copying the whole set.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol

import numpy as np
import torch

from ..errors import PhalanxError

# (batch of raw examples, per-example augmentation parameters or None) -> model-ready float batch
Transform = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]

CIFAR_TRAIN_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)]
CIFAR_TEST_FILE = "test_batch.bin"
CIFAR_CROP = 24


def _identity(x: torch.Tensor, params: Optional[torch.Tensor]) -> torch.Tensor:
    return x


class ExampleSet(Protocol):
    """What the readers and checks use of a set of examples, whatever holds them: an :class:`ArrayDataset`,
    :class:`~phalanx.data.columns.Columns` (a tree of tensors in memory) or
    :class:`~phalanx.data.lazy.LazyExamples` (the user's Dataset, read by loader workers)."""

    def __len__(self) -> int: ...

    @property
    def augment_params(self) -> Optional[Callable[[int, torch.Generator], torch.Tensor]]: ...

    @property
    def example_shape(self) -> tuple[int, ...]: ...

    @property
    def input_dtype(self) -> torch.dtype: ...

    @property
    def target_dtype(self) -> torch.dtype: ...

    @property
    def target_shape(self) -> tuple[int, ...]: ...

    def largest_target(self) -> int: ...

    def take(self, idx: torch.Tensor, params: Optional[torch.Tensor] = None) -> Any: ...

    def read(self, plan: Iterable[tuple[torch.Tensor, Optional[torch.Tensor]]]) -> Iterator[Any]: ...

    def subset(self, idx: torch.Tensor) -> ExampleSet: ...

    def cast(self, inputs: Optional[torch.dtype] = None, targets: Optional[torch.dtype] = None) -> ExampleSet: ...


@dataclasses.dataclass
class ArrayDataset:
    """Examples as one tensor ``x`` (first dimension: examples) and integer labels ``y``."""

    x: torch.Tensor
    y: torch.Tensor
    transform: Transform = _identity
    #: Draws per-example augmentation parameters: (count, generator) -> tensor, or None.
    augment_params: Optional[Callable[[int, torch.Generator], torch.Tensor]] = None

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise PhalanxError(f"data set has {len(self.x)} inputs but {len(self.y)} labels")
        if self.y.is_floating_point() or self.y.is_complex() or self.y.dtype == torch.bool:
            raise PhalanxError(f"labels are {str(self.y.dtype).replace('torch.', '')}: phalanx trains classifiers and "
                               "needs integer class labels 0..C-1 (y.long() if they are whole numbers)")
        if self.y.dim() != 1:
            raise PhalanxError(f"labels have shape {tuple(self.y.shape)}: give one class index per example, "
                               "shape (N,)")
        if len(self.y) and int(self.y.min()) < 0:
            raise PhalanxError(f"labels must be class indices 0..C-1, and {int(self.y.min())} is negative")
        self.y = self.y.long()

    def __len__(self) -> int:
        return len(self.x)

    # What the readers and checks use, the same on a lazily read Dataset (see lazy.py).
    @property
    def example_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @property
    def input_dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def target_dtype(self) -> torch.dtype:
        return self.y.dtype

    @property
    def target_shape(self) -> tuple[int, ...]:
        return tuple(self.y.shape[1:])

    def largest_target(self) -> int:
        return int(self.y.max())

    def take(self, idx: torch.Tensor, params: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The examples ``idx`` as one model-ready batch (``params``: their augmentation, if any)."""
        return self.transform(self.x[idx], params), self.y[idx]

    def read(self, plan: Iterable[tuple[torch.Tensor, Optional[torch.Tensor]]]
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of ``plan`` ((indices, augmentation) per batch), in order: one gather each."""
        return (self.take(idx, params) for idx, params in plan)

    def subset(self, idx: torch.Tensor) -> "ArrayDataset":
        return dataclasses.replace(self, x=self.x[idx], y=self.y[idx])

    def cast(self, inputs: Optional[torch.dtype] = None, targets: Optional[torch.dtype] = None) -> "ArrayDataset":
        return dataclasses.replace(self, x=self.x if inputs is None else self.x.to(inputs),
                                   y=self.y if targets is None else self.y.to(targets))


@dataclasses.dataclass
class DataBundle:
    name: str
    train: ExampleSet
    test: ExampleSet
    input_shape: tuple[int, ...]
    num_classes: int
    held_out: str = "test"  #: what the evaluation set is called: "test", or "validation" (held out of train)
    notes: tuple = ()  #: header lines about the data (a cast of the inputs)


def load_digits(seed: int = 0) -> DataBundle:
    """scikit-learn's 1,797 real 8×8 digits; a fixed stratified split of 1,437 / 360.

    Kept in phalanx's cache once made (see :func:`_cached`): importing scikit-learn costs every
    process that loads the digits about a second, the digits themselves a millisecond.
    """
    x_train, y_train, x_test, y_test = _cached(f"digits-seed{seed}", "scikit-learn", lambda: _make_digits(seed))
    return DataBundle("digits", ArrayDataset(x_train, y_train), ArrayDataset(x_test, y_test), (1, 8, 8), 10)


def _make_digits(seed: int) -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    d = _load()
    x = torch.from_numpy((d.images / 16.0).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(d.target.astype(np.int64))
    idx_train, idx_test = train_test_split(
        np.arange(len(y)), test_size=0.2, random_state=seed, stratify=d.target
    )
    mean, std = x[idx_train].mean(), x[idx_train].std()
    x = (x - mean) / std
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def cache_dir() -> Path:
    """Where phalanx keeps what it derived once: ``$PHALANX_CACHE``, else ``$XDG_CACHE_HOME/phalanx``,
    else ``~/.cache/phalanx``."""
    if os.environ.get("PHALANX_CACHE"):
        return Path(os.environ["PHALANX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "phalanx"


def _cached(name: str, source: str, make: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """``make()``'s tensors, from the cache when ``source`` (a package) is at the version that made them.

    Written whole or not at all (a temporary file renamed), so concurrent jobs never read half a
    file; an unwritable cache only means making them again next time.
    """
    from importlib.metadata import version

    path = cache_dir() / f"{name}-{source}-{version(source)}.pt"
    try:
        return tuple(torch.load(path, weights_only=True))
    except (OSError, RuntimeError, EOFError, ValueError):
        pass  # not made yet, or unreadable: make it again
    tensors = make()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save(list(tensors), f)
        os.replace(tmp, path)
    except OSError:
        pass
    return tensors


def _read_cifar(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    raw = np.fromfile(path, dtype=np.uint8)
    record = 1 + 3 * 32 * 32
    if raw.size == 0 or raw.size % record:
        raise PhalanxError(
            f"{path} is not a CIFAR-10 binary file ({raw.size} bytes is not a whole number of "
            f"{record}-byte records); download the 'CIFAR-10 binary version' and point --data-dir at it"
        )
    raw = raw.reshape(-1, record)
    return torch.from_numpy(raw[:, 1:].reshape(-1, 3, 32, 32).copy()), torch.from_numpy(raw[:, 0].astype(np.int64))


def cifar_augment_params(count: int, gen: torch.Generator) -> torch.Tensor:
    """Per image: crop top, crop left, flip (0/1)."""
    span = 32 - CIFAR_CROP + 1
    return torch.stack(
        [torch.randint(0, span, (count,), generator=gen), torch.randint(0, span, (count,), generator=gen),
         torch.randint(0, 2, (count,), generator=gen)], dim=1,
    )


def standardize(x: torch.Tensor) -> torch.Tensor:
    """Per-image standardization: zero mean, unit variance (floor on the std as TF does)."""
    flat = x.flatten(1)
    mean = flat.mean(1, keepdim=True)
    floor = 1.0 / flat.shape[1] ** 0.5
    std = flat.std(1, unbiased=False, keepdim=True).clamp_min(floor)
    return ((flat - mean) / std).view_as(x)


def cifar_train_transform(x: torch.Tensor, params: Optional[torch.Tensor]) -> torch.Tensor:
    """Random 24×24 crop and horizontal flip (parameters drawn per image), then standardize."""
    assert params is not None
    rows = params[:, 0, None] + torch.arange(CIFAR_CROP)  # (N, 24)
    cols = params[:, 1, None] + torch.arange(CIFAR_CROP)
    flip = params[:, 2].bool()
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    n = torch.arange(len(x))[:, None, None, None]
    c = torch.arange(3)[None, :, None, None]
    crops = x[n, c, rows[:, None, :, None], cols[:, None, None, :]]
    return standardize(crops.float())


def cifar_eval_transform(x: torch.Tensor, params: Optional[torch.Tensor]) -> torch.Tensor:
    off = (32 - CIFAR_CROP) // 2
    return standardize(x[:, :, off:off + CIFAR_CROP, off:off + CIFAR_CROP].float())


def check_cifar10_files(data_dir: str | os.PathLike | None) -> Path:
    """The CIFAR-10 directory, once every binary file is known to be there (else a clear error)."""
    expected = ", ".join(CIFAR_TRAIN_FILES + [CIFAR_TEST_FILE])
    if data_dir is None:
        raise PhalanxError(f"--data cifar10 needs --data-dir DIR holding {expected}")
    root = Path(data_dir)
    missing = [f for f in CIFAR_TRAIN_FILES + [CIFAR_TEST_FILE] if not (root / f).is_file()]
    if missing:
        raise PhalanxError(
            f"CIFAR-10 files missing in {root}: {', '.join(missing)} (expected {expected}, "
            "from the 'CIFAR-10 binary version' archive)"
        )
    return root


def cifar10_sizes(data_dir: str | os.PathLike | None) -> tuple[int, int]:
    """(training, test) examples, from the files' sizes (records of 1 + 3·32·32 bytes), without reading them."""
    root = check_cifar10_files(data_dir)
    record = 1 + 3 * 32 * 32
    train = sum((root / f).stat().st_size for f in CIFAR_TRAIN_FILES) // record
    return train, (root / CIFAR_TEST_FILE).stat().st_size // record


def load_cifar10(data_dir: str | os.PathLike | None) -> DataBundle:
    """CIFAR-10 from its binary distribution (``data_batch_1.bin`` … ``test_batch.bin``)."""
    root = check_cifar10_files(data_dir)
    parts = [_read_cifar(root / f) for f in CIFAR_TRAIN_FILES]
    x_train, y_train = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    x_test, y_test = _read_cifar(root / CIFAR_TEST_FILE)
    return DataBundle(
        "cifar10",
        ArrayDataset(x_train, y_train, cifar_train_transform, cifar_augment_params),
        ArrayDataset(x_test, y_test, cifar_eval_transform),
        (3, CIFAR_CROP, CIFAR_CROP), 10,
    )


def load_synthetic(shape: tuple[int, ...] = (3, 24, 24), num_classes: int = 10, size: int = 4096,
                   seed: int = 0) -> DataBundle:
    """Random inputs labelled by a fixed random linear teacher: learnable, and free to make."""
    if size < 2 or any(s < 1 for s in shape) or num_classes < 2:
        raise PhalanxError(f"synthetic data needs size >= 2, positive shape and >= 2 classes; got "
                           f"size {size}, shape {tuple(shape)}, {num_classes} classes")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, *shape, generator=gen)
    teacher = torch.randn(int(np.prod(shape)), num_classes, generator=gen)
    y = (x.flatten(1) @ teacher).argmax(1)
    n_test = max(1, size // 5)
    return DataBundle(
        "synthetic", ArrayDataset(x[n_test:], y[n_test:]), ArrayDataset(x[:n_test], y[:n_test]),
        tuple(shape), num_classes,
    )


DATASETS = ("digits", "cifar10", "synthetic")


def load_data(name: str, data_dir: str | None = None, synthetic_shape: tuple[int, ...] = (3, 24, 24),
              synthetic_size: int = 4096, seed: int = 0) -> DataBundle:
    if name == "digits":
        return load_digits(seed)
    if name == "cifar10":
        return load_cifar10(data_dir)
    if name == "synthetic":
        return load_synthetic(synthetic_shape, 10, synthetic_size, seed)
    raise PhalanxError(f"unknown data set {name!r}: choose one of {', '.join(DATASETS)}")
