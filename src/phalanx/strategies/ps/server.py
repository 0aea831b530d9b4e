"""The parameter server's loop (rank 0): apply gradients in arrival order, answer with parameters.

The server hears every worker on its own receiving thread (a blocking ``recv`` per worker: gloo
completes point-to-point work only inside ``wait``, so one thread per peer is what lets the
server hear whoever is ready first) and puts the messages on one queue; the main loop applies
them in arrival order, so no worker can starve another. Each worker has at most one message in
flight (it waits for the reply), so the queue holds at most one message per worker.

Each gradient is applied as it arrives, scaled by 1/W, so W gradients move the parameters as
far as one synchronous step with their average; its staleness (the server's version minus the
version it was computed on, in updates) is recorded. With an SSP bound of 0 the server instead
waits for every live worker's gradient of the step and applies their average once: exactly what
``sync`` computes. A worker whose connection drops is reported lost and no longer counted.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Optional

import torch
from torch.nn.utils import parameters_to_vector

from ...errors import WorkerFailed
from ..staleness import StalenessStats
from . import protocol
from .gate import Gate
from .protocol import BYE, HELLO, PUSH, Message, Reply


class Server:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world_size: int,
                 device: torch.device, bound: Optional[int], steps: int):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.params = list(model.parameters())
        self.size = sum(p.numel() for p in self.params)
        self.workers = world_size - 1
        self.steps = steps  # the run's global steps: replies say stop once they are reached
        self.bound = bound
        self.gate = Gate(range(1, world_size), bound)
        self.staleness = StalenessStats(bound)
        self.applied = 0  # gradients applied so far (the parameters' version)
        self.draining = False
        self.waiting: set[int] = set()  # workers whose reply is held back by the gate
        self.stopped: set[int] = set()  # workers told to stop
        self.pending: dict[int, torch.Tensor] = {}  # SSP(0): gradients of the current step
        self.step_losses: list[float] = []
        self.max_lead = 0  # the largest lead over the slowest worker at any step start
        self.lost: list[tuple[int, int]] = []  # (worker, global step)
        self.pushed: dict[int, int] = {}  # gradients each worker says it pushed (from its BYE)
        self.replies = 0
        self.last_version = 0
        self.versions_out_of_order = 0  # replies whose version was older than an earlier one (must stay 0)
        self.inbox: queue.Queue = queue.Queue()
        self.receivers = [threading.Thread(target=self._receive, args=(w,), daemon=True)
                          for w in sorted(self.gate.live)]
        for thread in self.receivers:
            thread.start()

    @property
    def live(self) -> set[int]:
        return self.gate.live

    # ---- receiving ----
    def _receive(self, worker: int) -> None:
        try:
            while True:
                message = protocol.receive(worker, self.size, self.device)
                if message.kind == BYE:
                    self.pushed[worker] = message.pushed
                    return
                self.inbox.put(message)
        except Exception as e:  # the connection closed: the worker died (or finished)
            self.inbox.put(Message(worker, -1, error=str(e).splitlines()[0][:200] if str(e) else type(e).__name__))

    # ---- the loop ----
    def global_step(self) -> int:
        return self.applied // self.workers

    def serve_one_step(self) -> torch.Tensor:
        """Serve messages until one more global step (W gradients) has been applied; its mean loss."""
        target = self.global_step() + 1
        self.step_losses = []
        while self.global_step() < target:
            self._handle(self._next_message())
        return torch.tensor(sum(self.step_losses) / max(len(self.step_losses), 1))

    def _next_message(self) -> Message:
        if not self.live:
            raise WorkerFailed(0, "every worker was lost; the parameter server cannot continue (the last "
                                  "checkpoint is intact: --resume from it)")
        return self.inbox.get()

    def _handle(self, message: Message) -> None:
        worker = message.worker
        if message.kind == PUSH:
            self._apply(message)
            self.gate.tick(worker)
            self._release_or_hold(worker)
        elif message.kind == HELLO:
            self._release_or_hold(worker)
        else:
            self._lose(worker, message.error)
        self._release_waiting()

    def _apply(self, message: Message) -> None:
        self.staleness.record(self.applied - message.version)
        self.step_losses.append(message.loss)
        if self.bound == 0 and not self.draining:  # SSP(0): one averaged update per step, as sync
            self.pending[message.worker] = message.grad
            if len(self.pending) >= len(self.live):
                self._apply_pending()
            return
        self._step(message.grad, 1)

    def _apply_pending(self) -> None:
        grads = list(self.pending.values())
        self.pending.clear()
        self._step(torch.stack(grads).sum(0), len(grads))

    def _step(self, grad: torch.Tensor, count: int) -> None:
        """Apply the sum of ``count`` gradients, scaled by 1/W."""
        grad = grad / self.workers
        offset = 0
        for p in self.params:
            p.grad = grad[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.applied += count

    def _held(self, worker: int) -> bool:
        """SSP(0) holds a worker whose gradient waits in this step's average; any bound holds a leader."""
        return (self.bound == 0 and worker in self.pending) or not self.gate.may_start(worker)

    def _release_or_hold(self, worker: int) -> None:
        if self._held(worker):
            self.waiting.add(worker)
        else:
            self._reply(worker)

    def _release_waiting(self) -> None:
        for worker in sorted(self.waiting):
            if worker in self.live and not self._held(worker):
                self.waiting.discard(worker)
                self._reply(worker)

    def _reply(self, worker: int) -> None:
        # Say stop as soon as the target is reached, so that no worker computes a step too many.
        stop = self.draining or self.global_step() >= self.steps
        if not stop:  # the worker begins a step now: the bound must hold
            self.max_lead = max(self.max_lead, self.gate.lead(worker))
        reply = Reply(self.applied, stop, self.global_step())
        try:
            protocol.send_reply(worker, reply, parameters_to_vector(self.params).detach().contiguous(), self.device)
        except Exception as e:  # it died after its last push reached us: lost, like any other
            self._lose(worker, str(e).splitlines()[0][:200])
            return
        self.replies += 1
        self.versions_out_of_order += reply.version < self.last_version
        self.last_version = reply.version
        if stop:
            self.stopped.add(worker)

    def _lose(self, worker: int, why: str) -> None:
        if worker not in self.live:
            return
        self.gate.lose(worker)
        self.waiting.discard(worker)
        self.pending.pop(worker, None)
        self.lost.append((worker, self.global_step()))
        if worker not in self.stopped:
            print(f"worker {worker} lost at step {self.global_step()}; continuing with {len(self.live)} workers",
                  flush=True)
        if self.bound == 0 and self.pending and len(self.pending) >= len(self.live):
            self._apply_pending()

    def drain(self) -> None:
        """After the last step: apply what is still in flight and tell every live worker to stop."""
        self.draining = True
        if self.pending:
            self._apply_pending()
        for worker in sorted(self.waiting & self.live):
            self.waiting.discard(worker)
            self._reply(worker)
        while self.live - self.stopped:
            message = self.inbox.get()
            if message.kind not in (PUSH, HELLO):
                self._lose(message.worker, message.error)
                continue
            if message.kind == PUSH:  # computed before it heard stop: applied all the same
                self._apply(message)
                self.gate.tick(message.worker)
            self._reply(message.worker)

    def stats(self, final: bool = False) -> dict[str, Any]:
        out = {**self.staleness.to_dict(), "gradients_applied_total": self.applied, "max_clock_gap": self.max_lead,
               "lost_workers": [{"worker": w, "step": s} for w, s in self.lost], "live_workers": len(self.live)}
        if final:  # the accounting a reader (or a test) can check: pushes per worker, replies in order
            out["gradients_pushed"] = {str(w): n for w, n in sorted(self.pushed.items())}
            out["replies"] = self.replies
            out["reply_versions_out_of_order"] = self.versions_out_of_order
        return out

    def close(self, timeout_s: float = 60.0) -> None:
        # A thread still blocked in recv when the process exits aborts it: wait for every BYE.
        for thread in self.receivers:
            thread.join(timeout_s)
