"""After a worker is lost: which ranks survived, agreed through the job's store, and a group of their own.

When a worker dies (SIGKILL, out of memory), its peers' next collective with it fails ("Connection closed by
peer") and the job's process group is broken: any collective over it fails or hangs. Where every rank holds
the whole model (sync, local-sgd, diloco), the survivors can still save it (``train/loop.py``); here they learn
who they are without that group, through the store (the launcher's, or torchrun's agent's, outlives any worker):

- each survivor records itself (``survivor/<rank>``: the step it holds; ``rng/<rank>``: its RNG state);
- the set is complete once every rank is recorded a survivor or gone: the launcher records a rank it saw die
  (:func:`.watch.say_gone`); in a world of two the peer lost is the other rank; elsewhere (torchrun's agent
  records nothing of ours) a rank not recorded within :data:`SETTLE_S` is taken for lost;
- the first survivor to see the set complete seals it (``compare_set``): every survivor reads that one set, and
  one recorded after the seal is not in it and saves nothing;
- where the survivors combine their replicas they make a gloo group of their own, a fresh rendezvous in the
  store under its own prefix, never the broken one (:meth:`Survivors.group`).

Parent side, :func:`let_survivors_save`: the launcher, having seen a worker die, lets the others end on their own
(they save, then fail on the broken group) for up to :data:`SAVE_GRACE_S` before it ends them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from multiprocessing import connection as mp_connection

from .watch import is_gone, launcher_view

#: How long a survivor waits for ranks that neither recorded themselves nor were recorded gone (only where no
#: launcher of ours records the dead: a live peer notices the loss at its next collective, within a step).
SETTLE_S = 5.0
#: How long the launcher lets the survivors of a lost worker save before it ends them.
SAVE_GRACE_S = 120.0


@dataclasses.dataclass
class Survivors:
    """The ranks that survived a lost peer, as every one of them reads it (sealed in the store)."""

    ranks: tuple[int, ...]  #: in rank order; the first writes the checkpoint
    rank: int  #: this process's
    world_size: int  #: the job's, the lost ranks included
    store: Any = dataclasses.field(repr=False, default=None)  #: the launcher's view of the job's store
    timeout_s: float = 60.0
    _group: Any = dataclasses.field(repr=False, default=None)

    @property
    def writer(self) -> int:
        return self.ranks[0]

    @property
    def lost(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.world_size) if r not in self.ranks)

    def rng(self) -> list[Optional[torch.Tensor]]:
        """Every rank's RNG state as it recorded it, by rank; None for a lost one (a resume leaves its own)."""
        return [_tensor(self.store.get(f"rng/{r}")) if r in self.ranks else None for r in range(self.world_size)]

    def done(self) -> None:
        """This survivor's part is over (saved, or given up): counted, so the launcher need not wait for a rank that
        never joined them (stuck in a collective with another survivor: gloo gives up only at its timeout)."""
        try:
            self.store.add("survivors-done", 1)
        except Exception:
            pass

    def group(self) -> Optional[dist.ProcessGroup]:
        """A gloo group of the survivors alone (None: this rank is the only one). Every survivor calls it."""
        if len(self.ranks) == 1:
            return None
        if self._group is None:
            prefix = dist.PrefixStore("survivors-group/", self.store)
            self._group = dist.ProcessGroupGloo(prefix, self.ranks.index(self.rank), len(self.ranks),
                                                timedelta(seconds=self.timeout_s))
        return self._group


def survivors(store: Optional[dist.Store], rank: int, world_size: int, step: int, timeout_s: float = 60.0,
              settle_s: float = SETTLE_S) -> Optional[Survivors]:
    """This rank, having lost a peer while it held ``step``: the sealed set of survivors (None where it is not in
    it, or the store is gone with the lost rank: nothing can be agreed)."""
    view = launcher_view(store)
    if view is None:
        return None
    try:
        # torch's stub says str; the binding takes bytes as well (a std::string either way)
        view.set(f"rng/{rank}", _bytes(torch.get_rng_state()))  # type: ignore[arg-type]
        view.set(f"survivor/{rank}", str(step))
        deadline = time.monotonic() + settle_s
        while True:
            found = [r for r in range(world_size) if view.check([f"survivor/{r}"])]
            accounted = len(found) + sum(is_gone(view, r) for r in range(world_size) if r not in found)
            if accounted >= world_size or (world_size == 2 and found == [rank]) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        sealed = json.loads(view.compare_set("survivors", "", json.dumps(found)))
    except Exception:  # (the store was the lost rank's: torchrun without its agent's store)
        return None
    if rank not in sealed:
        return None
    return Survivors(tuple(sealed), rank, world_size, view, timeout_s)


def _bytes(t: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(t, buffer)
    return buffer.getvalue()


def _tensor(data: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(data), weights_only=True)


# --------------------------------------------------------------------------- parent side


def let_survivors_save(processes: list, alive: set, store: dist.Store, drain: Callable[[], None],
                       grace_s: float = SAVE_GRACE_S) -> None:
    """A worker died without a word: wait for the others to end on their own, after saving what they hold, until
    every survivor of the sealed set is done (``store``: the launcher's view) or ``grace_s`` passed; ``drain()``
    meanwhile (their reports must not block them in a full pipe)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(processes[r].is_alive() for r in alive) and not _all_done(store):
        drain()
        mp_connection.wait([processes[r].sentinel for r in alive if processes[r].is_alive()], timeout=0.2)


def _all_done(store: dist.Store) -> bool:
    try:
        if not store.check(["survivors", "survivors-done"]):
            return False
        return store.add("survivors-done", 0) >= len(json.loads(store.get("survivors")))
    except Exception:  # (the store is going away with the job)
        return False
