"""The parameter server's loop (rank 0): take gradients in arrival order, update, answer with parameters.

Hearing: one receiving thread per worker (a blocking ``recv`` each: gloo completes point-to-point
work only inside ``wait``, so one thread per peer is what lets the server hear whoever is ready
first) puts the messages on one queue, and the main loop handles them in arrival order, so no
worker can starve another. Each worker has at most one message in flight (it waits for the
reply), so the queue holds at most one message per worker.

Updating: the aggregation rule (``aggregate.py``) says which gradients the server takes and when
the ones it holds become one update: ``ps`` applies each as it arrives, scaled by 1/W; rounds
(``backup``, and ``ssp`` with K = 0) average the first W − B computed on the current parameters
and drop the late ones. A worker whose gradient waits for its round gets no reply until the round
is applied, and the SSP gate (``gate.py``) holds a worker that leads the slowest by more than the
bound. Every gradient pushed is applied once or counted as dropped; each worker's BYE says how many
it pushed, so the accounting can be checked.

Buffers (BatchNorm's running statistics): an update takes the buffers that came with the gradient
of the lowest-numbered worker in it (for ``ps``, its one gradient's), and every reply carries the
server's. That is DDP's rule (rank 0's buffers are broadcast before every forward), so ``ssp:0``
and ``backup:0`` equal ``sync``, buffers included; checkpoints and evaluation use the server's.

A pushed loss that is not finite stops the server at once: it applies nothing more and answers
no one (the job is ending), and the loop names that step (see ``ServerRuntime.next_step``); the
worker's push says whether its inputs held NaN, so the data, not the learning rate, can be named.

A worker whose connection drops is reported lost and no longer counted (in the gate, in quorums),
and so is one that stays silent for the hang timeout while the server expects its gradient (it is
stopped, frozen or stuck): the others go on. The server never blocks on one worker: each worker's
replies go out through a sender thread of its own, so a worker that stops reading holds up only
its own sender. A worker that raised an exception is not lost: it recorded so in the job's store
before its connection dropped, and the server stops with it (a bug in the user's code is every
worker's: going on would lose the workers one by one and name none of their tracebacks).
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch.nn.utils import parameters_to_vector

from ...errors import WorkerFailed
from ...launcher.watch import STARTUP_S
from ...comm.staleness import StalenessStats
from . import protocol
from .aggregate import Rule
from .gate import Gate
from .protocol import BYE, HELLO, NO_TARGETS, PUSH, Message, Reply, buffer_count, buffers_to_vector, vector_to_buffers

log = logging.getLogger(__name__)


def apply_gradients(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, grads: list[torch.Tensor],
                    weight: float, clip: Optional[Callable[[], None]] = None) -> None:
    """One update of ``params``: ``weight`` times the sum of ``grads`` (flat vectors the caller gives up:
    the first is summed into and scaled in place), stepped by ``optimizer``. The parameters' gradients
    are views of that one vector: no pass over the bytes beyond the sum and the scaling, and no new
    buffer, whose first touch (page faults) costs more than the pass (the estimate prices this very
    function: ``estimate/timings.py``). ``clip``: clips the gradients so set, before the step (the update's
    gradient is the one ``--clip-grad-norm`` bounds)."""
    grad = grads[0]
    for other in grads[1:]:
        grad.add_(other)
    grad.mul_(weight)
    offset = 0
    for p in params:
        p.grad = grad[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    if clip is not None:
        clip()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class Server:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world_size: int,
                 device: torch.device, bound: Optional[int], rule: Rule, steps: int, hang_timeout_s: float = 0.0,
                 raised: Callable[[int], bool] = lambda worker: False, clip: Optional[Callable[[], None]] = None,
                 gone: Callable[[int], None] = lambda worker: None):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.raised = raised  #: whether a worker recorded that it raised (``watch.say_raised``), as it went
        self.gone = gone  #: records a worker lost before it was told to stop: it will not leave with the others
        self.clip = clip  #: clips every update's gradient before the optimizer applies it (None: no clipping)
        self.params = list(model.parameters())
        self.size = sum(p.numel() for p in self.params)
        self.buffer_size = buffer_count(model)
        self.workers = world_size - 1
        self.steps = steps  # the run's global steps: replies say stop once they are reached
        self.rule = rule
        self.gate = Gate(range(1, world_size), bound)
        self.staleness = StalenessStats(bound)
        self.updates = 0  # updates applied to the parameters: their version
        self.applied = 0  # gradients applied in this run
        self.applied_in_flight = 0  # of those, the ones in flight at the last step, applied by drain()
        self.dropped: collections.Counter = collections.Counter()  # worker -> gradients dropped
        self.pending: dict[int, Message] = {}  # gradients taken, waiting for their update
        self.draining = False
        self.waiting: set[int] = set()  # workers whose reply is held back
        self.stopped: set[int] = set()  # workers told to stop
        self.step_losses: list[float] = []
        self.diverged: Optional[Message] = None  # the first push whose loss was not finite: serving ends there
        self.diverged_step = 0  # the global step that push belongs to
        self.max_lead = 0  # the largest lead over the slowest worker at any step start
        self.lost: list[tuple[int, int]] = []  # (worker, global step)
        self.pushed: dict[int, int] = {}  # gradients each worker says it pushed (from its BYE)
        self.replies = 0
        self.last_version = 0
        self.versions_out_of_order = 0  # replies whose version was older than an earlier one (must stay 0)
        self.hang_timeout_s = hang_timeout_s
        self.checked = time.monotonic()
        self.expecting: dict[int, float] = {w: time.monotonic() for w in self.gate.live}  # worker -> since when
        self.inbox: queue.Queue = queue.Queue()
        self.outboxes: dict[int, queue.Queue] = {w: queue.Queue() for w in self.gate.live}
        self.receivers = {w: threading.Thread(target=self._receive, args=(w,), daemon=True) for w in self.gate.live}
        self.senders = [threading.Thread(target=self._send, args=(w,), daemon=True) for w in sorted(self.gate.live)]
        for thread in list(self.receivers.values()) + self.senders:
            thread.start()

    @property
    def live(self) -> set[int]:
        return self.gate.live

    def start_at(self, step: int) -> None:
        """Resumed at global ``step``: the parameters' version goes on from there."""
        self.updates = self.last_version = step * self.rule.per_step

    # ---- receiving ----
    def _receive(self, worker: int) -> None:
        try:
            while True:
                message = protocol.receive(worker, self.size, self.buffer_size, self.device)
                if message.kind == BYE:
                    self.pushed[worker] = message.pushed
                    return
                self.inbox.put(message)
        except Exception as e:  # the connection closed: the worker died (or finished)
            self._connection_lost(worker, e)

    def _send(self, worker: int) -> None:
        """Send this worker its replies, in order; a send that fails makes it lost, like any other."""
        while True:
            item = self.outboxes[worker].get()
            if item is None:
                return
            reply, parameters, buffers = item
            try:
                protocol.send_reply(worker, reply, parameters, buffers, self.device)
            except Exception as e:  # it died after its last push reached us
                self._connection_lost(worker, e)
                return

    def _connection_lost(self, worker: int, e: Exception) -> None:
        """Tell the loop (by a message, from a receiving or sending thread) that ``worker`` is gone."""
        self.inbox.put(Message(worker, -1, error=str(e).splitlines()[0][:200] if str(e) else type(e).__name__))

    # ---- the loop ----
    def global_step(self) -> int:
        return self.updates // self.rule.per_step

    def serve_one_step(self) -> torch.Tensor:
        """Serve messages until one more global step has been applied; the mean loss of its pushes."""
        target = self.global_step() + 1
        self.step_losses = []
        while self.global_step() < target and self.diverged is None:
            message = self._next_message()
            if message is not None:
                self._handle(message)
        if self.diverged is not None:
            return torch.tensor(self.diverged.loss)
        return torch.tensor(sum(self.step_losses) / max(len(self.step_losses), 1))

    def _next_message(self) -> Optional[Message]:
        """The next message, waiting; meanwhile (checked every second) a worker silent too long is lost. None
        where one was: no message may ever come (the others wait for their replies, or have stopped), so the
        caller looks again at what it waits for."""
        while True:
            if not self.live:
                raise WorkerFailed(0, "every worker was lost; the parameter server cannot continue (the last "
                                      "checkpoint is intact: --resume from it)")
            if self.hang_timeout_s > 0 and time.monotonic() - self.checked > 1.0:
                self.checked = time.monotonic()
                if self._lose_the_silent():
                    return None
            try:
                message = self.inbox.get(timeout=1.0 if self.hang_timeout_s > 0 else None)
            except queue.Empty:
                continue
            self.expecting.pop(message.worker, None)  # heard from: nothing expected until its next reply
            return message

    def _lose_the_silent(self) -> bool:
        """Lose every worker whose gradient is due for half the hang timeout: half, so that the others go
        on (and the job shows progress) well before the launcher would call the whole job hung. Returns
        whether one was lost."""
        now = time.monotonic()
        lost = False
        for worker, since in sorted(self.expecting.items()):
            # (a worker told to stop owes only its BYE; one that never spoke may still be starting)
            allowed = self.hang_timeout_s / 2 if self.gate.clock[worker] else max(self.hang_timeout_s, STARTUP_S)
            if worker in self.live and worker not in self.stopped and now - since > allowed:
                self._lose(worker, f"no message for {now - since:.0f} s: stopped, frozen or stuck")
                lost = True
        return lost

    def _handle(self, message: Message) -> None:
        worker = message.worker
        if message.kind == PUSH and not math.isfinite(message.loss) and message.inputs != NO_TARGETS:
            # Stop here: applying it would spread NaN, and replying would let the workers compute on.
            self.diverged, self.diverged_step = message, self.global_step() + 1
            return
        if message.kind == PUSH:
            self.gate.tick(worker)
            self._take(message)
            self._release_or_hold(worker)
        elif message.kind == HELLO:
            self._release_or_hold(worker)
        else:
            self._lose(worker, message.error)
        self._release_waiting()

    # ---- the aggregation rule at work ----
    def _take(self, message: Message) -> None:
        """Hold the gradient for its update, or drop it if the rule says it came too late."""
        if math.isfinite(message.loss):  # (a batch with no target: NaN, its gradient zero, left out of the loss)
            self.step_losses.append(message.loss)
        if not self.rule.admits(message.version, self.updates):
            self.dropped[message.worker] += 1
            return
        self.pending[message.worker] = message
        self._apply_if_ready()

    def _apply_if_ready(self) -> None:
        if self.pending and len(self.pending) >= self.rule.quorum(len(self.live)):
            taken = [self.pending[w] for w in sorted(self.pending)]
            self.pending.clear()
            self._apply(taken)

    def _apply(self, taken: list[Message]) -> None:
        """One update: the weighed sum of the gradients taken, and the first worker's buffers."""
        grads = []
        for message in taken:
            self.staleness.record(self.updates - message.version)
            assert message.grad is not None, "a gradient taken came with a push"
            grads.append(message.grad)
        apply_gradients(self.params, self.optimizer, grads, self.rule.weight(len(taken)), self.clip)
        if taken[0].buffers is not None:  # taken is in worker order: the lowest-numbered worker's
            vector_to_buffers(taken[0].buffers, self.model)
        self.updates += 1
        self.applied += len(taken)

    def _held(self, worker: int) -> bool:
        """A worker waits while its gradient waits for its update, or while it leads by more than the bound."""
        return not self.draining and (worker in self.pending or not self.gate.may_start(worker))

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
        reply = Reply(self.updates, stop, self.global_step())
        # A copy of the parameters as they are now, sent by the worker's own thread: never blocks here.
        self.outboxes[worker].put((reply, parameters_to_vector(self.params).detach().contiguous(),
                                   buffers_to_vector(self.model)))
        self.expecting[worker] = time.monotonic()  # its gradient (or, told to stop, its BYE) is due
        self.replies += 1
        self.versions_out_of_order += reply.version < self.last_version
        self.last_version = reply.version
        if stop:
            self.stopped.add(worker)

    def _lose(self, worker: int, why: str) -> None:
        if worker not in self.live:
            return
        if self.raised(worker):
            # A bug, not a lost machine: the user's code is the same on every worker, so the others would
            # raise it too, one by one, each read as lost ("every worker was lost"). Stop serving; the
            # worker's own traceback, sent home before its connection closed, is the job's error.
            raise WorkerFailed(worker, f"raised an exception at step {self.global_step()} (its traceback is "
                                       f"worker {worker}'s own); the parameter server stops with it")
        self.gate.lose(worker)
        self.waiting.discard(worker)
        if self.pending.pop(worker, None) is not None:  # its round goes on without it
            self.dropped[worker] += 1
        self.expecting.pop(worker, None)
        self.outboxes[worker].put(None)  # its sender ends once any reply it is stuck on gives way
        self.lost.append((worker, self.global_step()))
        if worker not in self.stopped:
            self.gone(worker)
            hung = f" ({why})" if why.startswith("no message") else ""
            log.info("worker %s lost at step %s%s; continuing with %s workers", worker, self.global_step(), hung,
                     len(self.live))
        self._apply_if_ready()  # the others may have been waiting for it
        self._release_waiting()  # (its round went on without it: whoever that round held goes on too)

    def drain(self) -> bool:
        """After the last step: tell every live worker to stop, taking what is still in flight.

        A gradient in flight is taken by the rule as any other (``ps`` applies it); a round that the
        end of the run left incomplete is not applied, and its gradients are counted as dropped.
        Returns whether an update was applied (the parameters changed).
        """
        updates, applied = self.updates, self.applied
        self.draining = True
        for worker in sorted(self.waiting & self.live):
            self._reply(worker)
        self.waiting.clear()
        while self.live - self.stopped:
            message = self._next_message()
            if message is None:
                continue
            if message.kind not in (PUSH, HELLO):
                self._lose(message.worker, message.error)
                continue
            if message.kind == PUSH:
                self.gate.tick(message.worker)
                self._take(message)
            self._reply(message.worker)
        for worker in self.pending:
            self.dropped[worker] += 1
        self.pending.clear()
        self.close()  # every stopped worker's BYE, so that the summary's accounting is complete
        self.applied_in_flight = self.applied - applied
        return self.updates != updates

    # ---- what it reports ----
    @property
    def drops(self) -> bool:
        """Whether dropping is part of this run's story (rounds drop late gradients; ps only a lost one's)."""
        return self.rule.drops_late or bool(sum(self.dropped.values()))

    def stats(self, final: bool = False) -> dict[str, Any]:
        out = {**self.staleness.to_dict(), "gradients_applied_total": self.applied, "max_clock_gap": self.max_lead,
               "lost_workers": [{"worker": w, "step": s} for w, s in self.lost], "live_workers": len(self.live)}
        if self.drops:
            out["gradients_dropped_total"] = sum(self.dropped.values())
        if final:  # the accounting a reader (or a test) can check: pushes per worker, replies in order
            out["gradients_pushed"] = {str(w): n for w, n in sorted(self.pushed.items())}
            out["gradients_applied_in_flight"] = self.applied_in_flight
            if self.drops:
                out["gradients_dropped"] = {str(w): n for w, n in sorted(self.dropped.items())}
            out["replies"] = self.replies
            out["reply_versions_out_of_order"] = self.versions_out_of_order
        return out

    def dropped_line(self) -> Optional[str]:
        """``dropped 31 of 900 gradients (3.4%), all from worker 2`` (None where nothing can be dropped)."""
        total = sum(self.dropped.values())
        if not self.drops or not (total or self.rule.backup):  # nothing to say about ps, ssp or backup:0
            return None
        seen = self.applied + total
        line = f"dropped {total} of {seen} gradients ({100 * total / max(seen, 1):.1f}%)"
        who = [(n, w) for w, n in self.dropped.items() if n]
        if len(who) == 1:
            return f"{line}, all from worker {who[0][1]}"
        if who:
            line += ": " + ", ".join(f"{n} from worker {w}" for n, w in sorted(who, key=lambda t: (-t[0], t[1])))
        return line

    def in_flight_line(self) -> Optional[str]:
        """Why more gradients were applied than steps x workers: those computed when the last step was reached
        (a worker pushes without waiting, so some are on their way) are applied as any other, not thrown away."""
        if not self.applied_in_flight:
            return None
        return (f"applied {self.applied} gradients: {self.applied - self.applied_in_flight} in the "
                f"{self.global_step()} steps, and {self.applied_in_flight} in flight when the last step was reached "
                f"(computed by then, so applied before the final checkpoint, which holds them)")

    def close(self, timeout_s: float = 60.0) -> None:
        # A thread still blocked in recv when the process exits aborts it: wait for every BYE. A lost
        # worker's threads are left: either its connection closed (they ended) or it is frozen (they
        # never will; they are daemons, and the process leaves without waiting for them).
        if not self.draining:  # the run failed (diverged, or raised): no worker was told to stop, no BYE comes
            return
        lost = {w for w, _ in self.lost}
        for worker, thread in self.receivers.items():
            if worker not in lost:
                thread.join(timeout_s)
        for worker, outbox in self.outboxes.items():
            if worker not in lost:
                outbox.put(None)
