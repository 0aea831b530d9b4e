"""Inside a worker: this rank's data over the run, from where the run stands.

Positions count examples consumed, not steps: a resumed run whose global batch changed (another worker
count) continues where the old one stopped.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Optional

import torch

from ..data import Prefetcher, ShardedBatches
from ..data import batch as batches
from ..data.loader import Position, advance, prefetch_depth
from ..strategies import nonfinite_values


class Feed:
    """This rank's share of every global step (none on a rank that reads no data, e.g. a parameter server),
    read ahead of the towers where that pays."""

    def __init__(self, data: Any, batch_size: int, role: Any, layout: Any, seed: int, global_batch: int):
        self.data, self.batch_size, self.role, self.layout, self.seed = data, batch_size, role, layout, seed
        self.global_batch = global_batch
        self.batches = None if role.shard is None else ShardedBatches(data.train, batch_size, role.shard,
                                                                    layout.shards, seed)
        # Where the data stood at step start_step (a resume moves both).
        self.start_step, self.start_position = 0, Position(0, 0)
        self.prefetcher: Optional[Prefetcher] = None

    def example(self) -> Any:
        """The first batch of this rank's shard (None where it reads none): what the model is measured on."""
        return self.batches.one(0) if self.batches is not None else None

    def resume(self, step: int, position: Position) -> None:
        self.start_step, self.start_position = step, position

    def position(self, step: int) -> Position:
        """Where the data stands at ``step``: the examples consumed since the start position, in global batches."""
        return advance(self.start_position, step - self.start_step, len(self.data.train), self.global_batch)

    def inputs(self, step: int, device: torch.device, prefetch: Optional[int]) -> Iterator:
        """This rank's batches from ``step`` on (``None`` for every step where it reads no data)."""
        if self.batches is None:
            return itertools.repeat(None)
        self.prefetcher = Prefetcher(self.batches(self.position(step)), device, prefetch_depth(prefetch, device))
        return self.prefetcher

    def nonfinite_inputs(self, step: int) -> Optional[str]:
        """Whether the batches of ``step`` held NaN or infinity, read again from the data (see :meth:`_read_again`)."""
        for shard, batch in self._read_again(step):
            what = nonfinite_values(batch)
            if what:
                return f"{what} (data shard {shard})"
        return None

    def targetless(self, step: int) -> Optional[int]:
        """The data shard whose batch of ``step`` has no target to learn from (every integer target ``-100``,
        torch's and Hugging Face's ignore index), read again; None: none. Such a batch's loss is a mean over
        nothing, NaN, and its gradient zero: the model is unharmed."""
        return next((shard for shard, batch in self._read_again(step) if batches.targetless(batch)), None)

    def _read_again(self, step: int) -> Iterator[tuple[int, Any]]:
        """The batches of ``step``, (shard, batch), read again from the data: only once a loss was found
        non-finite, so an ordinary step never pays for it. Ranks in step read every shard, so they all name
        the same one without a collective; the others, their own."""
        if self.batches is None or step < 1:
            return
        at = self.position(step - 1)
        for shard in range(self.layout.shards) if self.layout.lockstep else (self.role.shard,):
            yield shard, ShardedBatches(self.data.train, self.batch_size, shard, self.layout.shards, self.seed).one(at)

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
