"""Stragglers, for studying them: the same absolute slowness whatever the strategy.

Who is slow, and how slow, is a :class:`Slowness` (``phalanx train --straggler``, and the
scenarios of ``phalanx compare``):

- ``RANK:FACTOR`` or ``slow:RANK:FACTOR``: that rank's compute takes FACTOR times as long, every step;
- ``pauses:P:FACTOR``: at every step each worker is, with probability P, FACTOR times as slow for
  that step (transient slowness: garbage collection, I/O, a noisy neighbour);
- ``none``.

"Compute" is calibrated before training: a rank that may be slowed times forward + backward on
its example batch, on a private copy of the bare model (no communication, no random numbers drawn
from the run; warm-up passes, then the median), and after every step it sleeps (factor - 1) x that
time. The delay is therefore the same absolute time whichever strategy runs and however long its
communication takes (a sleep in proportion to the step's wall time would charge ``sync`` again for
the waiting it already does).

Pauses are a pure function of (seed, step, worker) (:func:`pause_factor`), so every strategy meets
the same pauses: *worker* is the data shard a rank reads (worker i reads shard i in every
strategy: ``sync``'s rank i, the parameter server's rank i + 1), *step* counts the rank's own
steps (a parameter-server worker's own pushes, not the server's global step).

Before training every rank shares its calibration with the others (one ``all_gather_object``,
before any strategy starts its own communication), so rank 0 can print and record them all.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..data import batch as batches
from ..errors import PhalanxError
from ..task.step import DefaultStep, UserStep

KINDS = ("none", "slow", "pauses")
EXAMPLES = "RANK:FACTOR, slow:RANK:FACTOR or pauses:P:FACTOR (e.g. 1:2: rank 1 twice as slow; pauses:0.1:4)"


@dataclasses.dataclass(frozen=True)
class Slowness:
    """Who is slow and how slow; :meth:`factor_at` is pure."""

    kind: str = "none"  #: "none", "slow" (one rank, every step) or "pauses" (every worker, now and then)
    factor: float = 1.0  #: how many times as long a slowed step's compute takes
    rank: Optional[int] = None  #: slow: the rank
    probability: float = 0.0  #: pauses: the chance, per worker and step, of a pause

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PhalanxError(f"unknown slowness {self.kind!r}: choose one of {', '.join(KINDS)}")
        if not (isinstance(self.factor, (int, float)) and 1 <= self.factor < math.inf):
            raise PhalanxError(f"{self.text()}: the factor must be a number of at least 1 (2: twice as slow)")
        if self.kind == "slow" and (not isinstance(self.rank, int) or self.rank < 0):
            raise PhalanxError(f"{self.text()}: the rank must be 0 or more")
        if self.kind == "pauses" and not 0 < self.probability <= 1:
            raise PhalanxError(f"{self.text()}: the probability of a pause must be in (0, 1], e.g. 0.1")

    def text(self) -> str:
        """The spelling it was given in: ``none``, ``slow:1:2``, ``pauses:0.1:4``."""
        if self.kind == "slow":
            return f"slow:{self.rank}:{self.factor:g}"
        if self.kind == "pauses":
            return f"pauses:{self.probability:g}:{self.factor:g}"
        return "none"

    @property
    def active(self) -> bool:
        return self.kind != "none"

    def may_slow(self, rank: int) -> bool:
        """Whether ``rank`` can ever be slowed (and so needs its compute calibrated)."""
        return self.kind == "pauses" or (self.kind == "slow" and rank == self.rank)

    def factor_at(self, seed: int, step: int, rank: int, worker: int) -> float:
        """How many times as long ``rank`` (reading shard ``worker``) computes at its own ``step``."""
        if self.kind == "slow":
            return float(self.factor) if rank == self.rank else 1.0
        if self.kind == "pauses":
            return pause_factor(seed, step, worker, self.probability, self.factor)
        return 1.0


def pause_factor(seed: int, step: int, worker: int, probability: float, factor: float) -> float:
    """Pure: ``factor`` with probability ``probability``, else 1, drawn from (seed, step, worker) alone.

    A hash, not a random stream: the draw for one (step, worker) does not depend on how many draws
    came before it, so every strategy (and every resumed run) meets the same pauses.
    """
    return float(factor) if unit_draw(seed, step, worker) < probability else 1.0


def unit_draw(*keys: Any) -> float:
    """Pure: a number in [0, 1) drawn from ``keys`` alone (a hash: the same keys, the same number)."""
    digest = hashlib.blake2b(":".join(map(str, keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


def parse_slowness(text: Any, flag: str = "--straggler") -> Optional[Slowness]:
    """``1:2``, ``slow:1:2``, ``pauses:0.1:4`` or ``none`` -> a :class:`Slowness` (``none``: None).

    Also takes a ``Slowness`` or a ``(rank, factor)`` pair (the Python API's shorthand).
    """
    if text is None or isinstance(text, Slowness):
        return text if text is None or text.active else None
    if isinstance(text, (tuple, list)) and len(text) == 2:
        return Slowness("slow", float(text[1]), rank=int(text[0]))
    parts = str(text).strip().lower().split(":")
    try:
        if parts == ["none"]:
            return None
        if len(parts) == 2:
            return Slowness("slow", float(parts[1]), rank=int(parts[0]))
        if len(parts) == 3 and parts[0] == "slow":
            return Slowness("slow", float(parts[2]), rank=int(parts[1]))
        if len(parts) == 3 and parts[0] == "pauses":
            return Slowness("pauses", float(parts[2]), probability=float(parts[1]))
    except ValueError:
        pass
    except PhalanxError as e:
        raise PhalanxError(f"{flag} {text!r}: {str(e).split(': ', 1)[-1]}") from None
    raise PhalanxError(f"{flag} {text!r} is not {EXAMPLES}")


# --------------------------------------------------------------------------- calibration


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def calibrate(model: nn.Module, example: Any, step: Callable, accumulate: int, device: torch.device,
              warmup: int = 2, repeats: int = 5) -> float:
    """Median seconds of forward + backward of ``model`` on ``example`` (any batch, in ``accumulate`` parts).
    ``step``: the task's training step (``step(model, batch) -> StepResult``), or a loss ``(outputs, targets)``
    for a pair.

    A private copy is timed, under a forked random state: the model's parameters, gradients and
    buffers (BatchNorm statistics) stay untouched and the run's random streams draw nothing.
    """
    step = step if isinstance(step, (DefaultStep, UserStep)) else DefaultStep(step)
    batch = batches.to_device(example, device)
    size = batches.length(batch)
    seconds = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        private = copy.deepcopy(model).train()
        for _ in range(warmup + repeats):
            began = _now(device)
            for piece in batches.split(batch, accumulate):
                (step(private, piece).loss * (batches.length(piece) / size)).backward()
            seconds.append(_now(device) - began)
            private.zero_grad(set_to_none=True)
    return statistics.median(seconds[warmup:])


# --------------------------------------------------------------------------- in a worker


class Straggle:
    """One rank's slowness at work: :meth:`after_step` sleeps what the rank's factor says.

    ``compute`` holds every rank's calibrated compute seconds (None where a rank is never slowed);
    ``sleep`` is injectable so that a test can see each delay without waiting for it.
    """

    def __init__(self, slowness: Optional[Slowness], rank: int, worker: Optional[int], compute: list,
                 seed: int, sleep: Callable[[float], None] = time.sleep):
        self.slowness, self.rank, self.worker, self.seed = slowness, rank, worker, seed
        self.active = slowness is not None  #: whether a step may sleep at all (the loop calls after_step only then)
        self.compute = compute
        self.sleep = sleep
        self.step = 0  #: this rank's own steps so far
        self.delays: list[float] = []  #: the delay asked for after each step (seconds)
        self.slept = 0.0  #: seconds measured inside the sleeps

    @classmethod
    def start(cls, slowness: Optional[Slowness], ctx: Any, worker: Optional[int], model: nn.Module,
              example: Any, step: Callable, accumulate: int, seed: int, **kwargs: Any) -> "Straggle":
        """Calibrate this rank where it may be slowed, and share every rank's calibration.

        Called by every rank before the strategy's runtime exists (its ``all_gather_object`` must
        not interleave with a strategy's own messages). ``worker`` is the data shard this rank
        reads (None: it reads no data, and is never slowed).
        """
        if slowness is None or not slowness.active:
            return cls(None, ctx.rank, worker, [], seed, **kwargs)
        mine = None
        if slowness.may_slow(ctx.rank) and example is not None and worker is not None:
            mine = calibrate(model, example, step, accumulate, ctx.device)
        compute = [mine]
        if ctx.distributed:
            compute = [None] * ctx.world_size
            dist.all_gather_object(compute, mine)
        return cls(slowness, ctx.rank, worker, compute, seed, **kwargs)

    def begin(self, step: int) -> None:
        """Count this rank's steps from ``step`` (a resumed run meets the pauses it would have met)."""
        self.step = step

    def factor(self, step: int) -> float:
        if self.slowness is None or self.worker is None:
            return 1.0
        return self.slowness.factor_at(self.seed, step, self.rank, self.worker)

    def after_step(self) -> None:
        """Sleep (factor - 1) x this rank's calibrated compute: the same absolute delay in every strategy."""
        mine = self.compute[self.rank] if self.rank < len(self.compute) else None
        delay = (self.factor(self.step) - 1.0) * mine if mine is not None else 0.0
        self.step += 1
        if delay <= 0:
            return
        self.delays.append(delay)
        began = time.perf_counter()
        self.sleep(delay)
        self.slept += time.perf_counter() - began

    # ---- what rank 0 prints and records ----
    def lines(self) -> list[str]:
        s = self.slowness
        if s is None:
            return []
        known = {r: c for r, c in enumerate(self.compute) if c is not None}
        if s.kind == "slow":
            assert s.rank is not None, "Slowness checks that a slow rank is named"
            c = known.get(s.rank)
            if c is None:
                return [f"straggler: rank {s.rank} is {s.factor:g}x as slow (it reads no data: nothing to slow)"]
            return [f"straggler: rank {s.rank} is {s.factor:g}x as slow: its compute takes {c * 1e3:.1f} ms a step "
                    f"(calibrated), so it sleeps {(s.factor - 1) * c * 1e3:.1f} ms after every step"]
        spread = f"{min(known.values()) * 1e3:.1f}-{max(known.values()) * 1e3:.1f} ms" if known else "nothing"
        return [f"pauses: at every step each worker is, with probability {s.probability:g}, {s.factor:g}x as slow "
                f"for that step (it sleeps {s.factor - 1:g} x its calibrated compute, {spread})"]

    def fields(self) -> dict[str, Any]:
        if self.slowness is None:
            return {}
        return {"scenario": self.slowness.text(),
                "calibrated_compute_s": {str(r): c for r, c in enumerate(self.compute) if c is not None}}
