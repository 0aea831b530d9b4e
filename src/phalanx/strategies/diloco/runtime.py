"""DiLoCo's runtime: inner steps on the local weights, outer rounds on the global ones (see ``__init__``)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...data.batch import to_cpu
from ..base import COUNT_CORRECT, Build, Report, Runtime, SurvivorState
from ..replicas import average_buffers, average_over, verify_replicas
from .outer import average, due, fragment_bounds, fragment_offsets, wire_bytes
from .. import replica_state

if TYPE_CHECKING:
    from . import DiLoCo


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
        # Every fragment took a local step; those due are synced now (a round that fails leaves them owed).
        self.unsynced = set(range(len(self.fragments)))
        self._rounds(fragments)
        self.unsynced -= set(fragments)
        return loss

    def finish(self, stopping: bool = False) -> bool:
        """The last outer round, of every fragment with local steps since its own last round: the run's
        global model holds every step's work, and every rank holds it (evaluated and saved as it is). Not on
        a stop: the checkpoint holds the fragments that owe a round, and a resume takes them at their steps."""
        super().finish()
        if not self.unsynced or stopping:
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

    @torch.no_grad()
    def survivor_state(self, step: int, survivors) -> SurvivorState:
        """The outer round every fragment still owes, over the survivors' own group (their pseudo-gradients
        averaged in fp32; the lost worker's local steps since its last round are lost with it), then the global
        model it gives, saved as a checkpoint from which every rank starts a round (no rank's local replica in
        it: the lost one's is gone). ``self.steps`` already counts a step whose round failed."""
        group, owed = survivors.group(), sorted(self.unsynced)
        indices = [i for f in owed for i in range(*self.fragments[f])]
        pseudo = [self.global_params[i] - self.params[i].detach().float().cpu() for i in indices]
        average_over(pseudo, group)
        for i, m in zip(indices, pseudo):
            self.global_params[i].grad = m
        if indices:
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
        if 0 in owed:
            average_over(self.buffers, group)
            for g, b in zip(self.global_buffers, self.buffers):
                g.copy_(b)
        mine = to_cpu(Runtime.state_dict(self))
        state = {**mine, "model": self._global_state(mine["model"]),
                 "diloco": {"outer_optimizer": self.outer.state_dict(), "workers": [], "unsynced": []}}
        kept = "an outer round of its own pseudo-gradient" if group is None else \
            "an outer round of the survivors' averaged pseudo-gradients"
        return SurvivorState(self.steps, state, f"{kept}; the lost worker's local steps since its last round are "
                                                "lost with it")

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
        """The whole checkpoint in one file (one process; see :meth:`shard_state_dict` for 2+): ``model`` is the
        global model (what ``phalanx evaluate`` and other strategies load), ``optimizer`` rank 0's inner
        optimizer, and ``diloco`` the outer optimizer and every rank's local model and inner optimizer,
        gathered (a collective), so a resume is exact at any step, not only at sync steps. The other ranks
        return None."""
        mine = to_cpu(super().state_dict())
        workers: Optional[list[Any]] = [None] * self.ctx.world_size if self.ctx.is_main else None
        if self.ctx.distributed:
            dist.gather_object(mine, workers, dst=0)
        else:
            workers = [mine]
        if not self.ctx.is_main:
            return None
        return {**mine, "model": self._global_state(mine["model"]),
                "diloco": {"outer_optimizer": self.outer.state_dict(), "workers": workers,
                           "unsynced": sorted(self.unsynced)}}

    @property
    def writes_shards(self) -> bool:
        return self.ctx.distributed  # every rank's local model and inner optimizer in its own file

    def shard_state_dict(self) -> dict[str, Any]:
        """On 2+ workers (``replica_state.py``): the global model as the checkpoint's model, this rank's local
        model and inner optimizer as its replica, and ``diloco`` (equal on every rank, written once): the outer
        optimizer (by parameter name) and the fragments that owe a round. Nothing is gathered."""
        names = [name for name, _ in self.module.named_parameters()]  # (the outer optimizer's numbering)
        diloco = {"outer_optimizer": replica_state.by_name(self.outer.state_dict(), names),
                  "unsynced": sorted(self.unsynced)}
        return replica_state.shards(self.ctx, self._global_state(self.module.state_dict()), self.module,
                                    self.optimizer, diloco=diloco)

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
        """This rank's local model and inner optimizer where the checkpoint holds them for this worker count
        (a sharded one's replicas; a file's gathered ``workers``), else the global model; the global model,
        the outer optimizer and the fragments that owe a round as saved."""
        whole, own, note = replica_state.read(state, self.ctx, self.options.name, self.module, self.optimizer,
                                              equal=("diloco",), model="the global model")
        saved = whole.get("diloco")
        outer = saved.get("outer_optimizer") if saved else None
        if saved is not None and "workers" in saved:  # a file: every rank's state gathered into it
            own = saved["workers"][self.ctx.rank] if len(saved["workers"]) == self.ctx.world_size else None
        elif outer is not None:  # a sharded one: the outer optimizer by parameter name
            outer = replica_state.by_index(outer, [name for name, _ in self.module.named_parameters()])
        super().load_state_dict(own or whole)  # the local model and inner optimizer
        self.notes += [note] if note else []
        names = dict(self.module.named_parameters())
        index = {id(p): i for i, p in enumerate(self.params)}
        for name, p in names.items():
            self.global_params[index[id(p)]].copy_(whole["model"][name])
        for name, g in zip(self.buffer_names, self.global_buffers):
            if name in whole["model"]:
                g.copy_(whole["model"][name])
        if outer:
            self.outer.load_state_dict(outer)
        self.steps = int(state.get("step", 0))
        # Which fragments owe a round: as saved with the local models (none where every rank starts from
        # the global model: another strategy's checkpoint, another world size).
        owed = saved.get("unsynced", ()) if own is not None and saved is not None else ()
        self.unsynced = {f for f in owed if f < len(self.fragments)}

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
