"""The user's map-style Dataset left where it is (on disk), read by DataLoader workers: ``--loader-workers N``.

With ``--loader-workers 0`` a user's Dataset is read into memory once (``user.py``), the fast path.
With N > 0 it stays lazy: every batch is ``dataset[i]`` for the batch's indices, read by N torch
``DataLoader`` worker processes per rank, ahead of the step that needs it. Which indices is still
:class:`~phalanx.data.loader.ShardedBatches`'s plan, handed to the DataLoader as its
``batch_sampler``: each rank reads only its shard, in the order a run with 0 loader workers reads it
(the DataLoader keeps the sampler's order), and a resume needs nothing but the Position.

The loader workers are forked from a fork server (multiprocessing's ``forkserver``), never from
the rank itself: a rank holds threads (gloo's, the prefetcher's, the progress watch), and a fork of
a process with threads alive may inherit a lock another thread held, forever. The server is
single-threaded and imported torch once, so a worker is ready in milliseconds. A rank forked from
phalanx's fork server forks this server from itself as it starts, before it has a thread
(``phalanx/launcher/forkserver.py``, ``fork_loader_server``); elsewhere (a rank spawned, or started by
torchrun) the server starts as a new interpreter when the first batch is read.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import pickle
import select
import signal
import sys
import threading
import time
from typing import Any, Iterable, Iterator, NamedTuple, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from ..errors import PhalanxError
from ..launcher.forkserver import GUARD
from ..launcher.startup import PAUSE_MODULE, resume_collector
from . import batch as batches
from .columns import check_targets

#: What the loader workers' fork server imports before it forks them (see the module docstring), besides
#: the module defining the Dataset: each worker would otherwise import them again, seconds per worker.
#: First the module that makes the server and its workers ignore SIGTERM (a stop sent to the whole process
#: group is the rank's to handle: see ``phalanx/launcher/forkserver_signals.py``); then the collector turned off
#: for the imports (``phalanx/launcher/startup.py`` says why; each worker turns it on again).
LOADER_PRELOAD = [GUARD, PAUSE_MODULE, "__main__", "torch", __name__]


def as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError, RuntimeError) as e:
        raise PhalanxError(f"{name} must hold tensors or numpy arrays ({str(e).splitlines()[0][:120]})") from None


class LazyExamples:
    """A map-style Dataset of items of any structure (pairs, tuples, dicts of tensors), read a batch at a time
    (the same interface as an in-memory ArrayDataset: ``take``, ``read``, ``subset``, ``cast``). ``workers``:
    DataLoader worker processes reading it (0: read in this process). Items are collated by the Dataset's own
    ``collate_fn`` where it has one, else by torch's ``default_collate``."""

    augment_params = None  #: the user's Dataset augments in its own __getitem__, if at all

    def __init__(self, dataset: Any, workers: int, name: str, inputs: Optional[torch.dtype] = None,
                 targets: Optional[torch.dtype] = None, target_key: Optional[str] = None):
        self.dataset, self.workers, self.name = dataset, workers, name
        self.inputs, self.targets = inputs, targets  # dtypes to cast to (None: as the items come)
        self.target_key = target_key
        if len(dataset) == 0:
            raise PhalanxError(f"{name} is empty: give at least one example")
        first = self.take(torch.arange(1))
        x = batches.first_tensor(batches.inputs(first, target_key))
        y = batches.targets(first, target_key)
        self.example_shape = tuple(x.shape[1:]) if x is not None else ()
        self.input_dtype = x.dtype if x is not None else torch.float32
        self.target_shape = tuple(y.shape[1:]) if isinstance(y, torch.Tensor) else ()
        self.target_dtype = y.dtype if isinstance(y, torch.Tensor) else torch.long
        if y is not None and (y.is_complex() or y.dtype == torch.bool):
            raise PhalanxError(f"{name}: targets are {str(y.dtype).replace('torch.', '')}: give integer class "
                               "indices or float regression targets")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        item = read_item(self.dataset, i, self.name)
        if not (isinstance(item, (tuple, list)) and len(item) == 2) or isinstance(item[0], (tuple, list, dict)):
            return item  # a tree: collated as it is
        x, y = as_tensor(item[0], self.name), as_tensor(item[1], self.name)
        x = x if self.inputs is None or not x.is_floating_point() else x.to(self.inputs)
        y = y if self.targets is None or not y.is_floating_point() else y.to(self.targets)
        return x, y if y.is_floating_point() else y.long()

    @property
    def collate_fn(self) -> Any:
        return getattr(self.dataset, "collate_fn", None) or collate

    def take(self, idx: torch.Tensor, params: Optional[torch.Tensor] = None) -> Any:
        """The examples ``idx`` as one batch, read here."""
        return collate_items(self.collate_fn, [self[int(i)] for i in idx], self.name)

    def read(self, plan: Iterable[tuple[torch.Tensor, Optional[torch.Tensor]]]) -> Iterator[tuple[torch.Tensor,
                                                                                                    torch.Tensor]]:
        """The batches of ``plan``, in its order: read by the DataLoader workers, each a few batches ahead."""
        if not self.workers:
            yield from (self.take(idx) for idx, _ in plan)
            return
        indices = (idx.tolist() for idx, _ in plan)
        stream = iter(DataLoader(_Guarded(self), batch_sampler=indices, num_workers=self.workers,
                                 collate_fn=functools.partial(guarded, self.collate_fn, self.name),
                                 worker_init_fn=functools.partial(loader_worker, os.getpid()),
                                 multiprocessing_context=loader_context(self.module)))
        try:
            for batch in stream:
                if isinstance(batch, Unreadable):
                    raise PhalanxError(batch.message)
                yield batch
        finally:  # end the worker processes now, not whenever the iterator is collected
            end_workers(stream)
            # Free its queues' named semaphores now: a rank leaves with os._exit (no finalizers), and a
            # failing one's traceback holds this frame (the resource tracker would report them "leaked").
            del stream
            gc.collect()  # the iterator and the DataLoader hold each other

    @property
    def module(self) -> str:
        """The module that defines the user's Dataset (under the Subsets phalanx cut it into): what the loader
        workers' fork server imports once."""
        dataset = self.dataset
        while isinstance(dataset, Subset):
            dataset = dataset.dataset
        return type(dataset).__module__

    def subset(self, idx: torch.Tensor) -> "LazyExamples":
        subset = Subset(self.dataset, idx.tolist())
        if hasattr(self.dataset, "collate_fn"):
            setattr(subset, "collate_fn", self.dataset.collate_fn)  # torch's Subset keeps no collate_fn of its own
        return LazyExamples(subset, self.workers, self.name, self.inputs, self.targets, self.target_key)

    def cast(self, inputs: Optional[torch.dtype] = None, targets: Optional[torch.dtype] = None) -> "LazyExamples":
        return LazyExamples(self.dataset, self.workers, self.name, inputs or self.inputs, targets or self.targets,
                            self.target_key)

    def largest_target(self) -> int:
        """The largest class index: from the Dataset's ``targets`` (torchvision's convention) where it has
        them, else one pass over the set (inputs read and dropped), by the loader workers."""
        known = getattr(self.dataset, "targets", None)
        if known is not None:
            ys = [as_tensor(known, self.name)]
        else:
            n, step = len(self), 256
            read = (batches.targets(b, self.target_key)
                    for b in self.read((torch.arange(s, min(s + step, n)), None) for s in range(0, n, step)))
            ys = [y for y in read if isinstance(y, torch.Tensor)]
        for y in ys:
            check_targets(y, self.name)
        return max((int(y.max()) for y in ys if y.numel()), default=0)

    def check_sendable(self) -> None:
        """DataLoader workers (and spawned ranks) receive the Dataset by pickling: say so plainly when they cannot."""
        try:
            pickle.dumps(self.dataset)
        except Exception as e:
            first = (str(e).splitlines() or [type(e).__name__])[0][:160]
            raise PhalanxError(f"{self.name} ({type(self.dataset).__name__}) cannot be sent to the loader worker "
                               f"processes ({first}): define the Dataset class at module level and keep file "
                               "paths, not open files, in it") from None


def end_workers(stream: Any) -> None:
    """End a DataLoader iterator's worker processes, and wait for its queues' feeder threads to end too.

    torch closes the queues without waiting for their threads (``cancel_join_thread``: a thread writing to a
    dead worker's full pipe would never end). Each thread holds its queue's lock and semaphore (named POSIX
    semaphores) until it has flushed the close: where the rank went on to ``os._exit`` first, as a rank
    stopping at a step does, they were never unlinked, or unlinked but never unregistered, and the resource
    tracker warned of "leaked semaphore objects" as the job ended. The threads end at once once their
    workers have; one stuck on a dead worker's pipe is given torch's own 5 s, all of them together."""
    getattr(stream, "_shutdown_workers", lambda: None)()
    deadline = time.monotonic() + 5
    for q in [*getattr(stream, "_index_queues", ()), getattr(stream, "_worker_result_queue", None)]:
        feeder = getattr(q, "_thread", None)  # (None: nothing was ever put on it in this process)
        if feeder is not None:
            feeder.join(timeout=max(0.0, deadline - time.monotonic()))


class Unreadable(NamedTuple):
    """An example a loader worker could not read, sent home as a value. Raised there, it would arrive as the
    DataLoader's own error, its message the worker's whole traceback, and that traceback would hold the
    DataLoader's iterator (its queues' semaphores) until the rank's os._exit: "14 leaked semaphore objects"."""

    message: str


class _Guarded(Dataset):
    """The examples as the DataLoader workers read them: a failure to read one comes back as :class:`Unreadable`."""

    def __init__(self, examples: LazyExamples):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Any:
        try:
            return self.examples[i]
        except PhalanxError as e:
            return Unreadable(str(e))


def read_item(dataset: Any, i: int, name: str) -> Any:
    """``dataset[i]``; an error of the user's ``__getitem__`` (it may raise anything) is one line naming the example."""
    try:
        item = dataset[i]
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise PhalanxError(f"{name}[{users_index(dataset, i)}] cannot be read ({type(e).__name__}: {first}); fix "
                           "the Dataset's __getitem__ for that example, or the file it reads") from None
    if item is None:  # a __getitem__ that skips a bad example by returning nothing: no collate takes it
        raise PhalanxError(f"{name}[{users_index(dataset, i)}] is None: the Dataset's __getitem__ returned nothing "
                           "for that example; return the example, or leave it out of the Dataset")
    return item


def users_index(dataset: Any, i: int) -> int:
    """Index ``i`` of ``dataset`` as an index of the user's own Dataset (phalanx's split wraps it in Subsets)."""
    while isinstance(dataset, Subset):
        dataset, i = dataset.dataset, dataset.indices[i]
    return i


def guarded(collate_fn: Any, name: str, items: list[Any]) -> Any:
    """``collate_fn(items)``, in a loader worker: a batch holding an example that could not be read is the first
    such failure, and so is a batch that cannot be collated (see :class:`Unreadable`: raised here, the one line
    would reach the rank as ``Caught PhalanxError in DataLoader worker process 0`` and the worker's traceback)."""
    failed = next((item for item in items if isinstance(item, Unreadable)), None)
    if failed is not None:
        return failed
    try:
        return collate_items(collate_fn, items, name)
    except PhalanxError as e:
        return Unreadable(str(e))


def collate_items(collate_fn: Any, items: list[Any], name: str) -> Any:
    """``collate_fn(items)``; an error of the user's own ``collate_fn`` (it may raise anything) is one line."""
    try:
        return collate_fn(items)
    except PhalanxError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise PhalanxError(f"{name}: its collate_fn fails on a batch of {len(items)} items ({type(e).__name__}: "
                           f"{first}); make it take a list of the Dataset's items") from None


def collate(items: list) -> Any:
    """Pairs stacked as two tensors (the fast form), any other items by torch's ``default_collate``."""
    if not all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], torch.Tensor) for item in items):
        return batches.collate(items, "a Dataset")
    try:
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])
    except RuntimeError as e:
        raise PhalanxError(f"the items of a Dataset must all have the same shape ({str(e).splitlines()[0][:120]})"
                           ) from None


def loader_worker(reader: int, worker_id: int = 0) -> None:
    """A DataLoader worker's start: the collector on again (its fork server imported without it), SIGTERM and
    SIGHUP ignored, and it leaves once its rank is gone (both below)."""
    resume_collector()
    ignore_stop_signals(worker_id)
    leave_with(reader, worker_id)


def leave_with(reader: int, worker_id: int = 0) -> None:
    """In a loader worker: exit once the process reading its batches (``reader``, a rank) is gone.

    torch's own watchdog watches the worker's parent, here the fork server, and the fork server waits
    for its workers (they hold its "alive" pipe): a rank ended by the launcher (another rank failed)
    would leave both behind for ever, holding the job's stdout and stderr (a caller reading them to
    their end waits for ever) and the resource tracker, which reports the rank's semaphores only then."""
    try:
        gone = os.pidfd_open(reader)  # readable once the reader has exited (Linux 5.3 and later)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):
        return  # no pidfd: torch's watchdog alone

    def wait() -> None:
        select.select([gone], [], [])
        os._exit(0)

    threading.Thread(target=wait, name="phalanx-leave-with-rank", daemon=True).start()


def ignore_stop_signals(worker_id: int) -> None:
    """In a DataLoader worker: ignore SIGTERM and SIGHUP. torch's worker dies of a SIGTERM sent by anyone but
    its parent (its C++ handler), and of a SIGHUP by default, so a stop to the whole process group (Slurm,
    Kubernetes, a closed terminal) killed the loader workers and failed their rank's next batch before the
    rank could stop at a step and save. The rank ends its loader workers itself (an end-of-data message to
    each; a stuck one's watchdog sees its parent gone)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def loader_context(module: str) -> Any:
    """The fork server the loader workers start from: in a rank, its own, with torch and the Dataset's
    ``module`` imported once; in the launching process (a one-process run), phalanx's
    (``phalanx/launcher/forkserver.py``)."""
    from ..launcher.forkserver import preload

    inside_a_rank = multiprocessing.parent_process() is not None
    multiprocessing.set_forkserver_preload(LOADER_PRELOAD + [module] if inside_a_rank else preload())
    if inside_a_rank:  # the server finds the Dataset's module on this sys.path (Python 3.11 sends it none)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    return multiprocessing.get_context("forkserver")
