"""A parameter-server worker (ranks 1..W): compute a gradient, push it, take the parameters back.

The worker's optimizer is never stepped (the server owns the optimizer); what the worker holds
between replies is the server's parameters (and buffers) of the version it last heard. Its
forward pass updates the buffers (BatchNorm's running statistics), which go up with its gradient;
the next reply brings the server's back, as DDP broadcasts rank 0's before every forward. Its
view of the global step is the server's, and it stops when a reply says so, after saying BYE with
the number of gradients it pushed (the server checks that each was applied or counted as dropped).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch.nn.utils import vector_to_parameters

from ...data.batch import targetless
from ...task.metrics import Totals
from ..base import COUNT_CORRECT, Build, Runtime, as_batch, nonfinite_values
from .protocol import NO_TARGETS, WorkerChannel, buffer_count, buffers_to_vector, vector_to_buffers


class WorkerRuntime(Runtime):
    steps_optimizer = False  # the server's optimizer applies every update (and its LR scheduler steps there)

    def __init__(self, build: Build, description: str):
        super().__init__(build, description=description)
        self.params = list(self.model.parameters())
        self.channel = WorkerChannel(sum(p.numel() for p in self.params), buffer_count(self.model), self.ctx.device)
        self.version = self.pushes = self.step_seen = 0
        self.stop = False
        self.joined = False

    def train_step(self, batch: Any, y: Optional[torch.Tensor] = None, parts: Optional[int] = None) -> torch.Tensor:
        if not self.joined:
            self.channel.hello()
            self._pull()
            self.joined = True
            if self.stop:  # the run ended before this worker joined (it started late): nothing to compute
                return torch.zeros((), device=self.ctx.device)
        batch = as_batch(batch, y)
        loss = self.forward_backward(batch, parts=parts)
        grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in self.params])
        value = float(loss)  # the push needs it on the host anyway
        # Only a non-finite loss makes us look at the batch, so the server can say the data is the cause.
        inputs = "" if math.isfinite(value) else nonfinite_values(batch) or (NO_TARGETS if targetless(batch) else "")
        self.channel.push(self.version, value, grad, buffers_to_vector(self.model), inputs)
        self.pushes += 1
        self.model.zero_grad(set_to_none=True)
        self._pull()
        return loss

    def _pull(self) -> None:
        reply, flat, buffers = self.channel.reply()
        with torch.no_grad():
            vector_to_parameters(flat, self.params)
        if buffers is not None:
            vector_to_buffers(buffers, self.model)
        self.version, self.stop, self.step_seen = reply.version, reply.stop, reply.step
        if self.stop:  # BYE carries how many gradients we pushed, so the server can account for each
            self.channel.bye(self.pushes)

    def next_step(self, step: int) -> Optional[int]:
        # A worker's own count means nothing here: only the server's global step, or stop.
        return None if self.stop else self.step_seen

    def global_losses(self, losses: torch.Tensor) -> torch.Tensor:
        # The server sees every pushed loss and guards against divergence; workers do not judge.
        return torch.zeros_like(losses)

    def arrive_for_evaluation(self) -> None:
        pass  # the server evaluates alone, at its own steps

    def evaluate(self, batches, totals: Totals = COUNT_CORRECT) -> tuple[float, ...]:
        return tuple(totals.zeros().tolist())  # the server evaluates; workers are not in step with it

    def state_dict(self):
        return None  # the server's parameters are the model

    def load_state_dict(self, state) -> None:
        pass  # the first reply brings the server's (restored) parameters

    def finish(self, stopping: bool = False) -> bool:
        return False  # no collective: the server drains the workers instead (its model is the one saved)
