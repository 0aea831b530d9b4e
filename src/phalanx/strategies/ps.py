"""Asynchronous parameter server (``ps``) and stale-synchronous parallel (``ssp``).

Layout: rank 0 is the server and owns the parameters and the optimizer; ranks 1..W are the
workers (``--workers W`` counts workers, so W + 1 processes run). Who talks to whom, over
torch.distributed point-to-point (gloo or NCCL, so it runs across machines under torchrun too):

    worker -> server   HELLO                      (once)
    server -> worker   [version, stop] + parameters
    worker -> server   PUSH [version used, loss] + gradient      (every step)
    server -> worker   [version, stop] + parameters              (the reply is the next pull)

The server receives from every worker on its own thread (a blocking ``recv`` per worker: gloo
completes point-to-point work only inside ``wait``, so one thread per peer is what lets the
server hear whoever is ready) and puts the messages on one queue; its main loop applies them in
arrival order, so no worker can starve another. A worker whose connection drops is reported lost
and no longer counted. Each gradient is applied as it arrives, scaled by 1/W, so W gradients move
the parameters as far as one synchronous step with their average; the staleness of each (the
server's version minus the version it was computed on, in gradients) is recorded.

SSP(K): a worker may begin its step c only while c minus the slowest live worker's clock is at
most K; otherwise the server holds its reply. With K = 0 the server also waits for every live
worker's gradient of the step and applies their average once: exactly what ``sync`` computes.
``ps`` is SSP with no bound.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ..errors import PhalanxError, WorkerFailed
from .base import Strategy
from .staleness import StalenessStats

HELLO, PUSH, BYE = 0.0, 1.0, 2.0


@dataclasses.dataclass
class ParameterServer(Strategy):
    """Asynchronous parameter server: rank 0 serves, ranks 1..W train."""

    name: ClassVar[str] = "ps"
    lockstep: ClassVar[bool] = False
    bound: ClassVar[Optional[int]] = None  # ps: no staleness bound

    def __post_init__(self) -> None:
        super().__post_init__()
        self.stats_ = StalenessStats(self._bound())
        self.stop = False
        self.joined = False
        self.pushes = 0
        self.global_step_seen = 0

    def _bound(self) -> Optional[int]:
        return self.bound

    # ---- before the workers start ----
    def plan_devices(self, devices: list[torch.device]) -> list[torch.device]:
        return [devices[0]] + list(devices)  # one more process: the server, beside the first worker

    def check_world(self, world_size: int, devices: list[torch.device]) -> None:
        if world_size - 1 < 2:
            raise PhalanxError(
                f"--strategy {self.name} needs at least 2 workers (it runs one more process, the server): with "
                f"{world_size - 1} worker nothing runs asynchronously; use --workers 2 or more, or --strategy sync"
            )

    def role(self, rank: int) -> str:
        return "the parameter server (rank 0)" if rank == 0 else f"worker {rank}"

    def tolerates_loss_of(self, rank: int) -> bool:
        return rank != 0  # a worker may die; the server carries on without it

    def describe(self) -> str:
        return "ps (asynchronous parameter server)"

    def data_shard(self, ctx) -> tuple[int, int]:
        workers = ctx.world_size - 1
        return (0 if ctx.rank == 0 else ctx.rank - 1), workers

    def eval_shard(self, ctx) -> tuple[int, int]:
        return 0, 1  # the server evaluates the whole test set; workers do not evaluate

    # ---- inside a worker ----
    def setup(self, ctx, model, make_optimizer):
        buffers = [name for name, b in model.named_buffers() if b.is_floating_point()]
        if buffers:  # only parameters travel: the server's copy of these would never change
            raise PhalanxError(
                f"--strategy {self.name} sends parameters only, and this model also keeps state in buffers "
                f"({', '.join(buffers[:3])}{', ...' if len(buffers) > 3 else ''}, e.g. BatchNorm running "
                "statistics): use --strategy sync or local-sgd for it, or a model without such buffers"
            )
        model, optimizer = super().setup(ctx, model, make_optimizer)
        self.params = list(model.parameters())
        self.workers = ctx.world_size - 1
        if ctx.rank == 0:
            self.server = _Server(self, model, optimizer)
        return model, optimizer

    def train_step(self, x, y, loss_fn, accumulate=1):
        if self.ctx.rank == 0:
            return self.server.serve_one_step()
        if not self.joined:
            self._send_header([HELLO, 0.0, 0.0])
            self._receive_parameters()
            self.joined = True
        loss = self.forward_backward(x, y, loss_fn, accumulate)
        grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in self.params])
        self._send_header([PUSH, float(self.version), float(loss)])
        dist.send(grad.contiguous(), dst=0)
        self.pushes += 1
        self.model.zero_grad(set_to_none=True)
        self._receive_parameters()
        return loss

    def _send_header(self, values: list[float]) -> None:
        dist.send(torch.tensor(values, dtype=torch.float64, device=self.ctx.device), dst=0)

    def _receive_parameters(self) -> None:
        header = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        dist.recv(header, src=0)
        flat = torch.empty(sum(p.numel() for p in self.params), device=self.ctx.device)
        dist.recv(flat, src=0)
        with torch.no_grad():
            vector_to_parameters(flat, self.params)
        self.version, self.stop, self.global_step_seen = int(header[0]), bool(header[1]), int(header[2])
        if self.stop:  # BYE carries how many gradients we pushed, so the server can account for each
            self._send_header([BYE, float(self.pushes), 0.0])

    def next_step(self, step: int) -> Optional[int]:
        if self.ctx.rank == 0:
            return self.server.global_step()
        # A worker's own count means nothing here: only the server's global step, or stop.
        return None if self.stop else self.global_step_seen

    def global_loss(self, loss):
        # The server sees every pushed loss and guards against divergence; workers do not judge.
        return loss if self.ctx.rank == 0 else torch.zeros(())

    def finish(self) -> None:
        if self.ctx.rank == 0:
            self.server.drain()

    def evaluate(self, batches, device):
        if self.ctx.rank != 0:
            return 0, 0
        return self._local_evaluate(batches, device)

    def _local_evaluate(self, batches, device):
        model = self.module
        was = model.training
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in batches:
                correct += int((model(x.to(device)).argmax(1).cpu() == y).sum())
                total += len(y)
        model.train(was)
        return correct, total

    def checkpoint_state(self):
        return super().checkpoint_state() if self.ctx.rank == 0 else None

    def load_state(self, state):
        super().load_state(state)
        if self.ctx.rank == 0:
            self.server.applied = int(state["step"]) * self.server.workers

    def stats(self, final: bool = False) -> dict[str, Any]:
        if self.ctx is None or self.ctx.rank != 0:
            return {}
        return {**self.stats_.to_dict(), **self.server.stats(final)}

    def summary_lines(self) -> list[str]:
        if self.ctx is None or self.ctx.rank != 0:
            return []
        gap = max(self.server.gaps, default=0)
        return [self.stats_.line(f"; largest lead over the slowest worker: {gap} steps")]

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.close()


@dataclasses.dataclass
class SSP(ParameterServer):
    """Stale-synchronous parallel: a worker may run at most ``staleness`` steps ahead of the slowest."""

    name: ClassVar[str] = "ssp"
    #: how many steps a worker may run ahead of the slowest live worker (0: synchronous)
    staleness: int = 4

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise PhalanxError(f"--staleness must be 0 or more steps (0 is synchronous), got {self.staleness}")
        super().__post_init__()

    def _bound(self) -> Optional[int]:
        return self.staleness

    def describe(self) -> str:
        return f"ssp (parameter server, staleness bound {self.staleness})"


class _Server:
    """The server's state and loop (rank 0)."""

    def __init__(self, strategy: ParameterServer, model, optimizer):
        self.s, self.model, self.optimizer = strategy, model, optimizer
        self.ctx = strategy.ctx
        self.params = list(model.parameters())
        self.size = sum(p.numel() for p in self.params)
        self.workers = self.ctx.world_size - 1
        self.bound = strategy._bound()
        self.applied = 0  # gradients applied so far
        self.draining = False
        self.live = set(range(1, self.ctx.world_size))
        self.clock = {w: 0 for w in self.live}  # gradients pushed by each worker
        self.waiting: set[int] = set()  # workers whose reply is held back by the bound
        self.stopped: set[int] = set()
        self.pending: dict[int, torch.Tensor] = {}  # SSP(0): gradients of the current step
        self.step_losses: list[float] = []
        self.gaps: list[int] = []  # clock - slowest clock at every step start (for tests)
        self.lost: list[tuple[int, int]] = []
        self.inbox: queue.Queue = queue.Queue()
        self.pushed: dict[int, int] = {}  # gradients each worker says it pushed (from its BYE)
        self.replies: list[tuple[int, int]] = []  # (worker, version) of every reply, in order
        self.receivers = [threading.Thread(target=self._receive, args=(w,), daemon=True) for w in sorted(self.live)]
        for thread in self.receivers:
            thread.start()

    # ---- receiving ----
    def _receive(self, worker: int) -> None:
        try:
            while True:
                header = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
                dist.recv(header, src=worker)
                if header[0].item() == BYE:
                    self.pushed[worker] = int(header[1].item())
                    return
                grad = None
                if header[0].item() == PUSH:
                    grad = torch.empty(self.size, device=self.ctx.device)
                    dist.recv(grad, src=worker)
                self.inbox.put((worker, header.cpu(), grad))
        except Exception as e:  # the connection closed: the worker died (or finished)
            self.inbox.put((worker, None, str(e).splitlines()[0][:200]))

    # ---- the loop ----
    def global_step(self) -> int:
        return self.applied // self.workers

    def serve_one_step(self) -> torch.Tensor:
        """Serve messages until one more global step (W gradients) has been applied."""
        target = self.global_step() + 1
        self.step_losses = []
        while self.global_step() < target:
            self._handle(*self._next_message())
        return torch.tensor(sum(self.step_losses) / max(len(self.step_losses), 1))

    def _next_message(self):
        if not self.live:
            raise WorkerFailed(0, "every worker was lost; the parameter server cannot continue (the last "
                                  "checkpoint is intact: --resume from it)")
        return self.inbox.get()

    def _handle(self, worker: int, header, grad) -> None:
        if header is None:
            self._lose(worker, grad)
        elif header[0].item() == HELLO:
            self._release_or_hold(worker)
        else:
            self._apply(worker, int(header[1].item()), float(header[2].item()), grad)
            self.clock[worker] += 1
            self._release_or_hold(worker)
        self._release_waiting()

    def _apply(self, worker: int, version: int, loss: float, grad: torch.Tensor) -> None:
        self.s.stats_.record(self.applied - version)
        self.step_losses.append(loss)
        if self.bound == 0 and not self.draining:  # SSP(0): one averaged update per step, as sync
            self.pending[worker] = grad
            if len(self.pending) < len(self.live):
                return
            grad = torch.stack(list(self.pending.values())).sum(0)
            count = len(self.pending)
            self.pending.clear()
        else:
            count = 1
        self._step(grad / self.workers)
        self.applied += count

    def _step(self, grad: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.grad = grad[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _slowest(self) -> int:
        return min(self.clock[w] for w in self.live) if self.live else 0

    def _may_start(self, worker: int) -> bool:
        return self.bound is None or self.clock[worker] - self._slowest() <= self.bound

    def _release_or_hold(self, worker: int) -> None:
        if self.bound == 0 and worker in self.pending:
            self.waiting.add(worker)  # its step's average is not applied yet
        elif self._may_start(worker):
            self._reply(worker)
        else:
            self.waiting.add(worker)

    def _release_waiting(self) -> None:
        for worker in sorted(self.waiting):
            if worker in self.live and not (self.bound == 0 and worker in self.pending) and self._may_start(worker):
                self.waiting.discard(worker)
                self._reply(worker)

    def _reply(self, worker: int) -> None:
        # Say stop as soon as the target is reached, so that no worker computes a step too many.
        stop = self.draining or (self.s.total_steps is not None and self.global_step() >= self.s.total_steps)
        if not stop:  # the worker begins a step now: the bound must hold
            self.gaps.append(self.clock[worker] - self._slowest())
        header = torch.tensor([float(self.applied), float(stop), float(self.global_step())], dtype=torch.float64,
                              device=self.ctx.device)
        try:
            dist.send(header, dst=worker)
            dist.send(parameters_to_vector(self.params).detach().contiguous(), dst=worker)
        except Exception as e:  # it died after its last push reached us: lost, like any other
            self._lose(worker, str(e).splitlines()[0][:200])
            return
        self.replies.append((worker, self.applied))
        if stop:
            self.stopped.add(worker)

    def _lose(self, worker: int, why: str) -> None:
        if worker not in self.live:
            return
        self.live.discard(worker)
        self.waiting.discard(worker)
        self.pending.pop(worker, None)
        self.lost.append((worker, self.global_step()))
        if worker not in self.stopped:
            print(f"worker {worker} lost at step {self.global_step()}; continuing with {len(self.live)} workers",
                  flush=True)
        if self.bound == 0 and self.pending and len(self.pending) >= len(self.live):
            self._apply_pending()

    def _apply_pending(self) -> None:
        grad = torch.stack(list(self.pending.values())).sum(0)
        count = len(self.pending)
        self.pending.clear()
        self._step(grad / self.workers)
        self.applied += count

    def drain(self) -> None:
        """After the last step: apply what is still in flight and tell every live worker to stop."""
        self.draining = True
        if self.pending:
            self._apply_pending()
        for worker in sorted(self.waiting & self.live):
            self.waiting.discard(worker)
            self._reply(worker)
        while self.live - self.stopped:
            worker, header, grad = self.inbox.get()
            if header is None:
                self._lose(worker, grad)
                continue
            if header[0].item() == PUSH:  # computed before it heard stop: applied all the same
                self._apply(worker, int(header[1].item()), float(header[2].item()), grad)
                self.clock[worker] += 1
            self._reply(worker)

    def stats(self, final: bool = False) -> dict[str, Any]:
        out = {"gradients_applied_total": self.applied, "max_clock_gap": max(self.gaps, default=0),
               "lost_workers": [{"worker": w, "step": s} for w, s in self.lost], "live_workers": len(self.live)}
        if final:  # the accounting a reader (or a test) can check: pushes per worker, versions sent
            out["gradients_pushed"] = {str(w): n for w, n in sorted(self.pushed.items())}
            out["reply_versions"] = [v for _, v in self.replies]
        return out

    def close(self, timeout_s: float = 60.0) -> None:
        # A thread still blocked in recv when the process exits aborts it: wait for every BYE.
        for thread in self.receivers:
            thread.join(timeout_s)
