"""Deterministic sharding of batches across workers, and a bounded prefetch queue.

Each epoch has its own shuffle of the training set. The position in the data is a
:class:`Position`: the epoch and how many examples of its shuffle were consumed. A global step
at position (e, o) takes the slice ``[o, o + G)`` of epoch e's shuffle (G = batch per worker ×
workers); worker ``r`` takes the ``r``-th piece of it. So every worker sees a different part, the
union over workers is exactly what one process with batch G would see (this is what makes Sync
equal to one large batch), and resuming needs nothing but the position.

The position counts examples, not steps, so a run that resumes with another global batch (another
worker count) continues with the very next example of the epoch: nothing seen twice, nothing
skipped. When fewer than G examples are left in an epoch's shuffle they are left out (a different
few each epoch): every worker then takes the same number of equal-sized steps, so the collectives
stay in lockstep and no ``Join`` is needed.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator, NamedTuple, Optional, Union

import torch

from ..errors import PhalanxError
from .batch import pin, record_stream, to_device
from .datasets import ExampleSet


def epoch_generator(seed: int, epoch: int, stream: int) -> torch.Generator:
    """A generator for one (seed, epoch, purpose): the same on every worker and every run."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + epoch) * 7 + stream) % (2**63))


class Position(NamedTuple):
    """Where a run is in its data: the epoch, and the examples of that epoch's shuffle consumed."""

    epoch: int
    offset: int


def advance(start: Position, steps: int, size: int, global_batch: int) -> Position:
    """The position ``steps`` global steps of ``global_batch`` examples after ``start`` (pure).

    An epoch's tail shorter than a global batch is skipped, so the result always has room for
    one more step: it is exactly where the next batch begins.
    """
    epoch, offset = start
    if offset + global_batch > size:  # the tail of this epoch is dropped: the next step opens a new one
        epoch, offset = epoch + 1, 0
    left = (size - offset) // global_batch  # steps that still fit in this epoch
    if steps < left:
        return Position(epoch, offset + steps * global_batch)
    per_epoch = size // global_batch
    steps -= left
    return Position(epoch + 1 + steps // per_epoch, steps % per_epoch * global_batch)


class ShardedBatches:
    """This worker's batches, global step by global step, from any starting position."""

    def __init__(self, data: ExampleSet, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, augment: bool = True):
        self.data, self.batch_size, self.rank, self.world = data, batch_size, rank, world_size
        self.seed, self.shuffle, self.augment = seed, shuffle, augment
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = len(data) // self.global_batch
        if self.steps_per_epoch == 0:
            raise PhalanxError(
                f"global batch {self.global_batch} ({batch_size} per worker x {world_size} workers) "
                f"is larger than the {len(data)} training examples; use a smaller --batch-size"
            )

    def _epoch_plan(self, epoch: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        n = len(self.data)
        perm = torch.randperm(n, generator=epoch_generator(self.seed, epoch, 0)) if self.shuffle else torch.arange(n)
        params = None
        if self.augment and self.data.augment_params is not None:
            # Drawn for every example of the epoch at once, indexed by example: the same crop
            # for an example whatever the worker count or the step we resumed from.
            params = self.data.augment_params(n, epoch_generator(self.seed, epoch, 1))
        return perm, params

    def position(self, step: int) -> Position:
        """Where ``step`` global steps of this batch from the very beginning lead."""
        return advance(Position(0, 0), step, len(self.data), self.global_batch)

    def indices(self, offset: int, perm: torch.Tensor) -> torch.Tensor:
        """This worker's piece of the global batch that begins at ``offset`` of the epoch's shuffle."""
        start = offset + self.rank * self.batch_size
        return perm[start:start + self.batch_size]

    def plan(self, start: Union[int, Position] = 0) -> Iterator[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """This worker's (example indices, their augmentation or None) of every step from ``start``: all a
        reader needs, so an in-memory gather and DataLoader worker processes read the very same batches."""
        size = len(self.data)
        here = start if isinstance(start, Position) else self.position(start)
        epoch, offset = advance(here, 0, size, self.global_batch)  # past a tail too short for a batch
        while True:  # (epoch by epoch: a step costs a slice, where a Position per step cost microseconds)
            perm, params = self._epoch_plan(epoch)
            for at in range(offset, size - self.global_batch + 1, self.global_batch):
                idx = self.indices(at, perm)
                yield idx, None if params is None else params[idx]
            epoch, offset = epoch + 1, 0

    def __call__(self, start: Union[int, Position] = 0) -> Iterator[Any]:
        """Batches from ``start``: a :class:`Position`, or a step counted from the very beginning."""
        return self.data.read(self.plan(start))

    def one(self, start: Union[int, Position] = 0) -> Any:
        """The one batch at ``start``, read in this process (no DataLoader workers start for it)."""
        return self.data.take(*next(self.plan(start)))


def eval_batches(data: ExampleSet, batch_size: int, rank: int = 0, world_size: int = 1
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This worker's contiguous share of an evaluation set (shares differ by at most one example)."""
    n = len(data)
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size
    return data.read((torch.arange(start, min(start + batch_size, hi)), None) for start in range(lo, hi, batch_size))


_DONE = object()


def prefetch_depth(given: Optional[int], device: torch.device) -> int:
    """``--prefetch``, or its default for the device: 2 batches ahead on a GPU (the copy to the device
    overlaps the step), none on CPU. There the workers fill the cores, so the thread only competes with
    its own worker: reading each batch in the loop made 2-worker runs on 2 cores 1-11% faster a step
    (the digits mlp and cnn, sync and local SGD, 3 interleaved runs each)."""
    if given is not None:
        return given
    return 2 if device.type == "cuda" else 0


class Prefetcher:
    """Produce batches on a background thread, at most ``depth`` ahead of the consumer.

    The producer builds (and augments) the next batches while the towers compute, so they never
    wait on input when the loader can keep up. On CUDA the batch is pinned and copied with
    ``non_blocking=True`` on a side stream, so the copy overlaps the current step too.
    """

    def __init__(self, batches: Iterator, device: torch.device, depth: int = 2):
        if depth < 0:
            raise PhalanxError(f"prefetch depth must be 0 or more, got {depth}")
        self.device = device
        self.cuda = device.type == "cuda"
        self.stop = threading.Event()
        self.inline = iter(batches) if depth == 0 else None  #: depth 0: each batch read when it is asked for
        self.thread: Optional[threading.Thread] = None
        if self.inline is not None:
            return
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._produce, args=(batches,), daemon=True)
        self.thread.start()

    def _produce(self, batches: Iterator) -> None:
        try:
            for batch in batches:  # any batch tree: every tensor of it pinned and copied
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        batch = to_device(pin(batch), self.device, non_blocking=True)
                        ready = torch.cuda.Event()
                        ready.record(self.stream)
                    item: tuple[Any, Optional[torch.cuda.Event]] = (batch, ready)
                else:
                    item = (batch, None)
                while not self.stop.is_set():
                    try:
                        self.queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
        except BaseException as e:  # surface loader errors in the training thread
            self.queue.put(e)
            return
        finally:  # a reader holding DataLoader worker processes ends them here, in the thread that used it
            getattr(batches, "close", lambda: None)()
        self.queue.put(_DONE)

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> Any:
        if self.inline is not None:
            batch = next(self.inline)
            return batch if self.device.type == "cpu" else to_device(batch, self.device)
        item = self.queue.get()
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        batch, ready = item
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
            record_stream(batch, torch.cuda.current_stream(self.device))
        return batch

    def close(self) -> None:
        """Stop the producer and wait for it: a thread still inside a torch op while the
        interpreter shuts down aborts the whole process."""
        self.stop.set()
        if self.inline is not None:  # a reader holding DataLoader worker processes ends them now
            getattr(self.inline, "close", lambda: None)()
            return
        while self.thread is not None and self.thread.is_alive():
            try:
                while True:
                    self.queue.get_nowait()
            except queue.Empty:
                pass
            self.thread.join(timeout=0.1)
