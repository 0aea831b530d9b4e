"""DiLoCo: local steps with the run's optimizer, then an outer Nesterov step on the averaged pseudo-gradient.

DiLoCo (Douillard et al. 2023) and streaming DiLoCo (Douillard et al. 2025). Every worker keeps
two copies of the parameters: its **local** weights, which the run's optimizer (the *inner*
optimizer) steps on its own shard, and the **global** weights, equal on every rank, kept apart
(on the CPU: pinned memory beside a GPU, a separate copy beside the CPU). Every H steps:

    pseudo-gradient = global - local               (on every rank)
    averaged        = all-reduce mean over ranks   (the only communication)
    global          = outer SGD step(averaged)     (lr --outer-lr, Nesterov momentum --outer-momentum)
    local           = global                       (the inner optimizer state stays local)

With ``--fragments F`` (streaming DiLoCo) the parameters are cut into F contiguous fragments of
about equal size; fragment f goes through the same round at its own staggered steps, so each
sync sends 1/F of the model. Rounds are counted as torch's ``PeriodicModelAverager`` counts them
(a fragment with offset 0 syncs after steps 1, H+1, 2H+1, ...), so with outer lr 1 and no momentum
DiLoCo is exactly local-sgd. The run ends (:meth:`DiLoCoRuntime.finish`, after its last step
whatever stopped it) with an outer round of every fragment that took a local step since its last
round, whether H divides the steps or not, so the global model holds every step's work and every
rank holds it. Buffers (BatchNorm's running statistics) are not pseudo-gradients: they are averaged
over the ranks with fragment 0's rounds (integer step counts: rank 0's) and kept as the global
model's, which is what is evaluated and saved. ``--outer-precision`` sets the pseudo-gradient on the
wire (see :func:`average`); the outer step is always fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ClassVar, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..costs import DiLoCoCost
from ..simulate import DILOCO
from ..errors import PhalanxError
from ..options import option
from ..pipeline.balance import bounds, partition
from .base import COUNT_CORRECT, Build, Job, Layout, Options, Report, Runtime, data_parallel
from .registry import register
from .replicas import average_buffers, verify_replicas

PRECISIONS = ("fp32", "bf16", "int8")
#: the DiLoCo paper's outer momentum and worker count (Douillard et al. 2023: 8 workers, Nesterov 0.9)
PAPER_MOMENTUM, PAPER_WORKERS = 0.9, 8
#: bytes per element of the pseudo-gradient on the wire
WIRE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}


@dataclasses.dataclass(frozen=True)
class DiLoCo(Options):
    name: ClassVar[str] = "diloco"
    checkpoints_activations: ClassVar[bool] = True
    summary: ClassVar[str] = ("H local steps, then the averaged pseudo-gradient applied by an outer Nesterov SGD; "
                              "streaming fragments")

    sync_every: int = option(8, "sync every H inner optimizer steps")
    # Not the paper's 0.7 with Nesterov momentum 0.9: made for 8 workers, on 2 it overshoots (digits, 300 steps,
    # 3 seeds: the cnn at chance or diverged, lstm 0.59-0.78); without momentum every built-in model trains
    # (cnn 0.978-0.994, mlp 0.972-0.978, lstm 0.961-0.972). docs/diloco.md has the measurement.
    outer_lr: float = option(0.7, "the outer SGD's learning rate on the averaged pseudo-gradient")
    outer_momentum: float = option(0.0, "the outer SGD's Nesterov momentum (0: plain SGD; the paper's 0.9 needs "
                                        "many workers)")
    fragments: int = option(1, "streaming: split the parameters into F fragments synced at staggered steps")
    outer_precision: str = option("fp32", "the pseudo-gradient on the wire (reduced and applied in fp32)",
                                  choices=PRECISIONS)

    def __post_init__(self) -> None:
        if not isinstance(self.sync_every, int) or isinstance(self.sync_every, bool) or self.sync_every < 1:
            raise PhalanxError(f"--sync-every must be at least 1 step, got {self.sync_every!r}")
        if not self.outer_lr > 0:
            raise PhalanxError(f"--outer-lr must be positive, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise PhalanxError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if not isinstance(self.fragments, int) or isinstance(self.fragments, bool) or self.fragments < 1:
            raise PhalanxError(f"--fragments must be at least 1, got {self.fragments!r}")
        if self.fragments > self.sync_every:
            raise PhalanxError(f"--fragments {self.fragments} is more than --sync-every {self.sync_every}: each "
                               f"fragment syncs at its own step of every {self.sync_every}; use --fragments "
                               f"{self.sync_every} or fewer")
        if self.outer_precision not in PRECISIONS:
            raise PhalanxError(f"unknown --outer-precision {self.outer_precision!r}: choose {', '.join(PRECISIONS)}")

    def describe(self) -> str:
        momentum = f"Nesterov momentum {self.outer_momentum:g}" if self.outer_momentum else "no momentum"
        extra = f", {self.fragments} fragments" if self.fragments > 1 else ""
        wire = f", {self.outer_precision} pseudo-gradients" if self.outer_precision != "fp32" else ""
        return f"diloco (sync every {self.sync_every} steps, outer lr {self.outer_lr:g}, {momentum}{extra}{wire})"

    def header_notes(self, workers: int) -> list[str]:
        """The run header's word where the outer momentum is the paper's and the workers are few."""
        if self.outer_momentum < PAPER_MOMENTUM or workers >= PAPER_WORKERS:
            return []
        return [f"diloco: outer Nesterov momentum {self.outer_momentum:g} is the paper's setting, for {PAPER_WORKERS} "
                f"workers or more; on {workers} it overshoots (digits, 2 workers: the cnn at chance); --outer-momentum "
                "0, the default, trains every built-in model"]

    def layout(self, job: Job) -> Layout:
        if job.model is not None:
            fragment_bounds([p.numel() for p in job.model.parameters()], self.fragments)
        return data_parallel(job)

    def runtime(self, build: Build) -> Runtime:
        return DiLoCoRuntime(build, self)


# --------------------------------------------------------------------------- pure parts


# Its cost model, for phalanx estimate (costs/diloco.py); its simulated rule, for compare --simulate (simulate/periodic.py).
register(DiLoCo, cost=DiLoCoCost(), simulated=DILOCO)


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


def _to_cpu(value: Any) -> Any:
    """State with every tensor on the CPU (gathered objects are unpickled on rank 0's device otherwise)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


# --------------------------------------------------------------------------- the runtime


class DiLoCoRuntime(Runtime):
    """One worker: inner steps on its local weights; a collective only on the steps a fragment syncs.

    Communication: every rank takes every step (lockstep), and at a sync step every rank sends the
    same fragment's pseudo-gradient (one all-reduce, or two all-gathers for int8); no collective at
    log steps. Invariant: the global weights and the outer optimizer's momentum are equal on every
    rank, because every rank applies the same averaged pseudo-gradient with the same outer step.
    """

    def __init__(self, build: Build, options: DiLoCo):
        super().__init__(build, description=options.describe(), notes=options.header_notes(build.ctx.world_size))
        self.options = options
        if self.ctx.distributed:
            verify_replicas(self.model, self.ctx)
        self.params = list(self.model.parameters())  # the local weights: what the inner optimizer steps
        self.fragments = fragment_bounds([p.numel() for p in self.params], options.fragments)
        self.offsets = fragment_offsets(options.sync_every, options.fragments)
        pin = self.ctx.device.type == "cuda"
        self.global_params = [self._global_copy(p, pin) for p in self.params]
        # The buffers, and the global model's (the mean at fragment 0's last round), on their own device.
        named = list(self.model.named_buffers())
        self.buffer_names, self.buffers = [n for n, _ in named], [b for _, b in named]
        self.global_buffers = [b.detach().clone() for b in self.buffers]
        #: fragments with local steps since their last round (every rank the same: they step together)
        self.unsynced: set[int] = set()
        self.outer = torch.optim.SGD(self.global_params, lr=options.outer_lr, momentum=options.outer_momentum,
                                     nesterov=options.outer_momentum > 0)  # torch refuses Nesterov without momentum
        self.steps = 0  # inner steps taken: the loop's global step (restored from checkpoints)
        self.syncs = 0  # fragment syncs done
        self.bytes_sent = 0  # the pseudo-gradients' bytes this rank handed to the collectives

    @staticmethod
    def _global_copy(p: nn.Parameter, pin: bool) -> torch.Tensor:
        copy = p.detach().to("cpu", copy=True, dtype=torch.float32)
        return copy.pin_memory() if pin else copy

    def train_step(self, batch: Any, y: Optional[torch.Tensor] = None, parts: Optional[int] = None) -> torch.Tensor:
        loss = super().train_step(batch, y, parts)
        index, self.steps = self.steps, self.steps + 1
        fragments = due(index, self.options.sync_every, self.offsets)
        self._rounds(fragments)
        self.unsynced = set(range(len(self.fragments))) - set(fragments)
        return loss

    def finish(self) -> bool:
        """The last outer round, of every fragment with local steps since its own last round: the run's
        global model holds every step's work, and every rank holds it (evaluated and saved as it is)."""
        super().finish()
        if not self.unsynced:
            return False
        self._rounds(sorted(self.unsynced))
        self.unsynced = set()
        return True

    def _rounds(self, fragments: Sequence[int]) -> None:
        """One outer round of these fragments (one collective), and of the buffers with fragment 0's."""
        if not fragments:
            return
        self._sync([i for f in fragments for i in range(*self.fragments[f])])
        self.syncs += len(fragments)
        if 0 in fragments:
            self._sync_buffers()

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        """Every rank's buffers (and the global model's) become their mean over the ranks."""
        if self.ctx.distributed:
            average_buffers(self.buffers)
        for g, b in zip(self.global_buffers, self.buffers):
            g.copy_(b)

    @torch.no_grad()
    def _sync(self, indices: list[int]) -> None:
        """One outer round for the parameter tensors ``indices`` (one or more whole fragments)."""
        local = [self.params[i] for i in indices]
        glob = [self.global_params[i] for i in indices]
        device = self.ctx.device
        pseudo = [g.to(device, non_blocking=True) - p.float() for g, p in zip(glob, local)]
        mean = average(pseudo, self.options.outer_precision, self.ctx.world_size, self.ctx.distributed)
        self.bytes_sent += wire_bytes((p.numel() for p in pseudo), self.options.outer_precision)
        # The copy to the CPU waits for the device, so the non-blocking copies out of the pinned
        # global weights above are done before the outer step below writes into them.
        for g, m in zip(glob, mean):
            g.grad = m.to("cpu")
        self.outer.step()  # only these tensors have a gradient: SGD leaves the others (and their momentum) alone
        self.outer.zero_grad(set_to_none=True)
        for g, p in zip(glob, local):
            p.copy_(g, non_blocking=True)

    def global_losses(self, losses: torch.Tensor) -> torch.Tensor:
        # No collective: that would put a sync point at every log step (as local-sgd).
        return losses

    @contextlib.contextmanager
    def _global_weights(self) -> Iterator[None]:
        """The module holds the global model inside, weights and buffers (this rank's local ones again after)."""
        mine = self.params + self.buffers
        with torch.no_grad():
            local = [t.detach().clone() for t in mine]
            for t, g in zip(mine, self.global_params + self.global_buffers):
                t.copy_(g)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, saved in zip(mine, local):
                    t.copy_(saved)

    def evaluate(self, batches, totals=COUNT_CORRECT):
        # The model DiLoCo trains is the global one; between syncs each rank's local weights differ.
        with self._global_weights():
            return super().evaluate(batches, totals)

    # ---- checkpoints ----
    def state_dict(self) -> Optional[dict[str, Any]]:
        """Rank 0's checkpoint: ``model`` is the global model (what ``phalanx evaluate`` and other
        strategies load), ``optimizer`` rank 0's inner optimizer, and ``diloco`` the outer optimizer
        and every rank's local model and inner optimizer, gathered (a collective), so a resume is
        exact at any step, not only at sync steps. The other ranks return None."""
        mine = _to_cpu(super().state_dict())
        workers: list = [None] * self.ctx.world_size if self.ctx.is_main else None
        if self.ctx.distributed:
            dist.gather_object(mine, workers, dst=0)
        else:
            workers = [mine]
        if not self.ctx.is_main:
            return None
        return {**mine, "model": self._global_state(mine["model"]),
                "diloco": {"outer_optimizer": self.outer.state_dict(), "workers": workers,
                           "unsynced": sorted(self.unsynced)}}

    def _global_state(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's model state with the global model's weights and buffers in it."""
        index = {id(p): i for i, p in enumerate(self.params)}
        state = dict(local)
        for name, p in self.module.named_parameters(remove_duplicate=False):
            state[name] = self.global_params[index[id(p)]].clone()
        for name, g in zip(self.buffer_names, self.global_buffers):
            if name in state:  # (a non-persistent buffer is in no state dict)
                state[name] = g.detach().cpu().clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("diloco")
        if saved is not None and len(saved["workers"]) == self.ctx.world_size:
            super().load_state_dict(saved["workers"][self.ctx.rank])  # this rank's local model and inner optimizer
        else:
            # Another strategy's checkpoint, or another world size: every rank starts a round from the global model.
            super().load_state_dict(state)
        names = dict(self.module.named_parameters())
        index = {id(p): i for i, p in enumerate(self.params)}
        for name, p in names.items():
            self.global_params[index[id(p)]].copy_(state["model"][name])
        for name, g in zip(self.buffer_names, self.global_buffers):
            if name in state["model"]:
                g.copy_(state["model"][name])
        if saved is not None:
            self.outer.load_state_dict(saved["outer_optimizer"])
        self.steps = int(state.get("step", 0))
        # Which fragments owe a round: as saved with the local models (none where every rank starts from
        # the global model: another strategy's checkpoint, another world size).
        mine = saved is not None and len(saved["workers"]) == self.ctx.world_size
        self.unsynced = {f for f in saved.get("unsynced", ()) if f < len(self.fragments)} if mine else set()

    def report(self, final: bool = False) -> Report:
        per_sync = self.bytes_sent // self.syncs if self.syncs else 0
        fields = {"outer_syncs": self.syncs, "outer_bytes_sent": self.bytes_sent, "outer_bytes_per_sync": per_sync,
                  "outer_lr": self.options.outer_lr, "outer_momentum": self.options.outer_momentum}
        if not final:
            return Report(fields)
        sizes = [sum(self.params[i].numel() for i in range(*b)) for b in self.fragments]
        split = f" over {len(sizes)} fragments of {', '.join(f'{n:,}' for n in sizes)} parameters" \
            if len(sizes) > 1 else ""
        momentum = f"Nesterov momentum {self.options.outer_momentum:g}" if self.options.outer_momentum else \
            "no momentum"
        # The pseudo-gradient's own size; what it costs on the wire (the collective's algorithm, every
        # rank) is the summary's "bytes on the wire" line.
        line = (f"diloco: {self.syncs} fragment syncs{split}, a {per_sync:,}-byte {self.options.outer_precision} "
                f"pseudo-gradient per sync per worker, outer SGD lr {self.options.outer_lr:g}, "
                f"{momentum}")
        return Report({**fields, "fragment_sizes": sizes}, [line])
