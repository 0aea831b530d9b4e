"""Real gradients of the user's model at any parameters, many workers' at once.

The model is used as a function of a flat parameter vector (``torch.func.functional_call``): a
worker's parameters are one row of floats, wherever it got them (a version it pulled, its local
copy). Two ways to compute, by what the rule needs:

- :meth:`Gradients.mean`: workers on the *same* parameters whose gradients are only ever averaged
  (sync): their batches concatenated into one forward pass, the loss the mean of each shard's own
  loss, so the gradient is exactly the mean of theirs (DDP's), in one larger batch;
- :meth:`Gradients.each`: every worker's own gradient, on its own parameters (a parameter server
  applies them one by one; local SGD steps each copy): ``vmap`` over the workers, in chunks, so
  256 gradients of a small model are a few batched calls; where the model or loss cannot be
  vmapped (an LSTM), one worker after another, the same numbers.

Evaluations are not here: the world evaluates as a real run does (``world.py``).

Buffers (BatchNorm's running statistics) are not simulated: the template's are used as they are.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

CHUNK = 64  #: workers per vmapped call (bounds the memory of stacked parameters and activations)


class Gradients:
    def __init__(self, model: nn.Module, loss_fn: Callable):
        self.model, self.loss_fn = model, loss_fn
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.size = sum(self.numels)
        self.buffers = dict(model.named_buffers())
        self.vmappable: Optional[bool] = None  # learnt on the first call
        self.computed = 0  #: gradients computed (worker-steps)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape, n in zip(self.names, self.shapes, self.numels):
            out[name] = flat[offset:offset + n].view(shape)
            offset += n
        return out

    def _call(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, {**self.views(flat), **self.buffers}, (x,))

    def mean(self, flat: torch.Tensor, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
             ) -> tuple[torch.Tensor, float]:
        """The mean of the workers' gradients on ``flat`` (one per batch) and their mean loss."""
        leaf = flat.detach().requires_grad_(True)
        x = torch.cat([b[0] for b in batches])
        out = self._call(leaf, x)
        total, start = 0.0, 0
        for bx, by in batches:  # each shard's own mean loss, weighted 1/k: the mean of k gradients
            total = total + self.loss_fn(out[start:start + len(bx)], by)
            start += len(bx)
        loss = total / len(batches)
        (g,) = torch.autograd.grad(loss, leaf)
        self.computed += len(batches)
        return g, float(loss.detach())

    def each(self, flats, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, list[float]]:
        """Each worker's gradient (row i of the result) on its own parameters and batch ``batches[i]``.

        ``flats``: a (k, P) matrix of every worker's parameters (local copies), or a list of flat
        vectors, where workers on the same version hold the same tensor (versions are not copied
        into a stack when every worker of a chunk holds the same one)."""
        out = torch.empty(len(batches), self.size)
        losses: list[float] = []
        for lo in range(0, len(batches), CHUNK):
            hi = min(lo + CHUNK, len(batches))
            losses += self._chunk(flats[lo:hi], batches[lo:hi], out[lo:hi])
        self.computed += len(batches)
        return out, losses

    def _chunk(self, flats, batches, out: torch.Tensor) -> list[float]:
        if self.vmappable is not False and len({len(b[0]) for b in batches}) == 1:
            try:
                if isinstance(flats, torch.Tensor):
                    stacked, dims = flats.detach(), 0
                elif all(f is flats[0] for f in flats):
                    stacked, dims = flats[0].detach(), None
                else:
                    stacked, dims = torch.stack([f.detach() for f in flats]), 0
                xs, ys = torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches])

                def loss(flat, x, y):
                    return self.loss_fn(self._call(flat, x), y)

                g, values = vmap(grad_and_value(loss), in_dims=(dims, 0, 0))(stacked, xs, ys)
                self.vmappable = True
                out.copy_(g)
                return values.tolist()
            except Exception:  # the model or the loss has no batching rule: one worker at a time
                if self.vmappable:
                    raise
                self.vmappable = False
        losses = []
        for i, (flat, batch) in enumerate(zip(flats, batches)):
            g, value = self.mean(flat, [batch])
            out[i].copy_(g)
            losses.append(value)
        self.computed -= len(losses)  # counted by each()
        return losses
