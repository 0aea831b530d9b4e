"""The messages between a parameter server (rank 0) and its workers, over point-to-point.

    worker -> server   HELLO                                              (once)
    server -> worker   REPLY [version, stop, step] + parameters (+ buffers)
    worker -> server   PUSH [version used, loss, inputs] + gradient (+ buffers)   (every step)
    server -> worker   REPLY [version, stop, step] + parameters (+ buffers)  (the reply is the next pull)
    worker -> server   BYE [gradients pushed]                             (after a reply that says stop)

A worker's header is four float64 numbers, a reply's three (a PUSH's fourth says whether the
worker's inputs held NaN or infinity: looked at only when its loss was not finite, never on an
ordinary step); parameters and gradients travel as one flat vector in
the order of ``model.parameters()``. A model with buffers (BatchNorm's running statistics and
step count) also sends every buffer, as one float64 vector in the order of ``model.buffers()``
(exact for float32 values and for counts), after the gradient and after the parameters: the
buffers a worker updated in its forward pass go up with its gradient, the server's come down
with every reply. torch.distributed point-to-point (gloo or NCCL), so the same protocol runs
across machines under torchrun.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

HELLO, PUSH, BYE = 0, 1, 2
SERVER = 0
HEADER = 4  #: float64 numbers in a worker's header: kind and up to three values
#: A PUSH's inputs when its batch had no target (every label -100): its loss NaN, its gradient zero, nothing wrong.
NO_TARGETS = "no targets"
INPUTS = ("", "NaN", "infinity", NO_TARGETS)  #: what a PUSH's fourth number says about the worker's inputs


@dataclasses.dataclass
class Message:
    """What the server heard from one worker (``header is None``: the worker is gone)."""

    worker: int
    kind: int
    version: int = 0  #: PUSH: the parameter version the gradient was computed on
    loss: float = 0.0  #: PUSH: the worker's loss on that batch
    inputs: str = ""  #: PUSH with a non-finite loss: "NaN"/"infinity" when the worker's batch held them; NO_TARGETS
    pushed: int = 0  #: BYE: gradients this worker pushed in all
    grad: Optional[torch.Tensor] = None
    buffers: Optional[torch.Tensor] = None  #: PUSH: the worker's buffers after its forward pass
    error: str = ""  #: why the connection closed


@dataclasses.dataclass
class Reply:
    version: int  #: gradients applied so far
    stop: bool
    step: int  #: the global step (gradients applied / workers)


def _header(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, device=device)


def buffer_count(module: nn.Module) -> int:
    return sum(b.numel() for b in module.buffers())


def buffers_to_vector(module: nn.Module) -> torch.Tensor:
    """Every buffer of ``module`` as one float64 vector (empty for a model without buffers)."""
    parts = [b.detach().reshape(-1).to(torch.float64) for b in module.buffers()]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


@torch.no_grad()
def vector_to_buffers(vector: torch.Tensor, module: nn.Module) -> None:
    """Copy ``vector`` (from :func:`buffers_to_vector`) into ``module``'s buffers, each in its own dtype."""
    offset = 0
    for b in module.buffers():
        b.copy_(vector[offset:offset + b.numel()].view_as(b))
        offset += b.numel()


# ---- the worker's side ----

class WorkerChannel:
    """A worker's connection to the server: every call blocks until it is done."""

    def __init__(self, size: int, buffers: int, device: torch.device):
        self.size, self.buffers, self.device = size, buffers, device

    def hello(self) -> None:
        dist.send(_header([HELLO, 0.0, 0.0, 0.0], self.device), dst=SERVER)

    def push(self, version: int, loss: float, grad: torch.Tensor, buffers: torch.Tensor, inputs: str = "") -> None:
        dist.send(_header([PUSH, float(version), loss, float(INPUTS.index(inputs))], self.device), dst=SERVER)
        dist.send(grad.contiguous(), dst=SERVER)
        if self.buffers:
            dist.send(buffers.contiguous(), dst=SERVER)

    def bye(self, pushed: int) -> None:
        dist.send(_header([BYE, float(pushed), 0.0, 0.0], self.device), dst=SERVER)

    def reply(self) -> tuple[Reply, torch.Tensor, Optional[torch.Tensor]]:
        header = torch.zeros(3, dtype=torch.float64, device=self.device)
        dist.recv(header, src=SERVER)
        flat = torch.empty(self.size, device=self.device)
        dist.recv(flat, src=SERVER)
        buffers = _receive_buffers(self.buffers, SERVER, self.device)
        return Reply(int(header[0]), bool(header[1]), int(header[2])), flat, buffers


# ---- the server's side ----

def _receive_buffers(count: int, src: int, device: torch.device) -> Optional[torch.Tensor]:
    if not count:
        return None
    buffers = torch.empty(count, dtype=torch.float64, device=device)
    dist.recv(buffers, src=src)
    return buffers


def receive(worker: int, size: int, buffers: int, device: torch.device) -> Message:
    """The next message from ``worker`` (blocks; raises when the connection closes)."""
    header = torch.zeros(HEADER, dtype=torch.float64, device=device)
    dist.recv(header, src=worker)
    kind, a, b, c = (v.item() for v in header)
    kind = int(kind)
    if kind == BYE:
        return Message(worker, BYE, pushed=int(a))
    if kind == PUSH:
        grad = torch.empty(size, device=device)
        dist.recv(grad, src=worker)
        return Message(worker, PUSH, version=int(a), loss=float(b), inputs=INPUTS[int(c)], grad=grad,
                       buffers=_receive_buffers(buffers, worker, device))
    return Message(worker, HELLO)


def send_reply(worker: int, reply: Reply, parameters: torch.Tensor, buffers: torch.Tensor,
               device: torch.device) -> None:
    dist.send(_header([float(reply.version), float(reply.stop), float(reply.step)], device), dst=worker)
    dist.send(parameters, dst=worker)
    if buffers.numel():
        dist.send(buffers.contiguous(), dst=worker)
