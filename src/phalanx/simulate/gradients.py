"""Real gradients of the user's model at any parameters, many workers' at once.

The task's step (``step(model, batch).loss``: the model called as its authors call it, on a batch of
any structure, its own loss or the user's ``--training-step``) is used as a function of a flat parameter
vector (``torch.func.functional_call``): a worker's parameters are one row of floats, wherever it got
them (a version it pulled, its local copy). Two ways to compute, by what the rule needs:

- :meth:`Gradients.mean`: workers on the *same* parameters whose gradients are only ever averaged
  (sync): pairs under the convention's step concatenated into one forward pass, the loss the mean of
  each shard's own loss, so the gradient is exactly the mean of theirs (DDP's), in one larger batch;
  any other step (a user's) on the whole batch the shards came from, where that is the mean of theirs:
  every shard as long, no target ignored (no negative class: ``-100``, ``-1``), and the step's loss a mean on the
  first call (its gradient on the whole batch against the shards' mean, one shard by one: a step that sums
  is computed shard by shard from then on, as is a batch whose targets it cannot see);
- :meth:`Gradients.each`: every worker's own gradient, on its own parameters (a parameter server
  applies them one by one; local SGD steps each copy): ``vmap`` over the workers (every tensor of
  their batch trees stacked), in chunks, so
  256 gradients of a small model are a few batched calls; where the model or loss cannot be
  vmapped (an LSTM), or, on the CPU, an op of it has no batching rule (attention: torch would loop inside
  vmap, slower than this), one worker after another, the same numbers.

Every tensor is on the device of the model it is given (the simulation's ``--devices``): on a GPU the workers'
gradients are fewer, larger calls (:meth:`Gradients.on_cpu`), and each loss is read back once per call, never
one by one, so the GPU's queue of work does not wait on it.

Evaluations are not here: the world evaluates as a real run does (``world.py``).

Buffers (BatchNorm's running statistics) are not simulated: the template's are used as they are.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.utils import _pytree as pytree

from ..data import batch as batches
from ..task.step import DefaultStep, calls_model_alone

CHUNK = 64  #: workers per vmapped call (bounds the memory of stacked parameters and activations)
#: on a GPU: fewer, larger calls (its memory holds 256 copies of a model of 100,000s of parameters and their
#: activations many times over, and each call's kernel launches are the cost there)
DEVICE_CHUNK = 256


class _Stepped(nn.Module):
    """The task's step as a module's forward: ``functional_call`` then gives the model the parameters it is
    called with, whatever the step does with the model (a dict of keyword inputs, two inputs, its own loss)."""

    def __init__(self, model: nn.Module, step: Callable):
        super().__init__()
        self.model, self.step = model, step

    def forward(self, batch: Any) -> torch.Tensor:
        return self.step(self.model, batch).loss


class Gradients:
    def __init__(self, model: nn.Module, loss_fn: Callable, step: Optional[Callable] = None, threads: int = 1):
        self.model, self.loss_fn = model, loss_fn
        #: torch's threads for the gradients; where workers are computed in turn, that many at once, one thread each
        self.threads = threads
        self.helpers: Optional[list[Gradients]] = None  #: a copy of the model per thread (:meth:`_helpers`)
        self.step = step or DefaultStep(loss_fn)
        self.stepped = _Stepped(model, self.step)
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.size = sum(self.numels)
        self.buffers = dict(model.named_buffers())
        #: where the model's parameters are, and so every gradient and loss (the simulation's device)
        self.device = next((p.device for _, p in named), torch.device("cpu"))
        self.on_cpu(self.device.type == "cpu")
        self.vmappable: Optional[bool] = None  # learnt on the first call
        self.whole_is_mean: Optional[bool] = None  # the step's loss on a whole batch is its shards' mean: learnt
        self.computed = 0  #: gradients computed (worker-steps)

    def on_cpu(self, cpu: bool) -> None:
        """How the workers are computed, by where (set from :attr:`device`; a test sets a GPU's on the CPU). A GPU
        is bound by kernel launches: vmapped calls of up to 256 workers, vmap kept where an op loops inside it (that
        op alone is launched once per worker), and no threads with copies of the model (one GPU runs one
        worker's kernels at a time). The CPU is bound by arithmetic: chunks of 64, workers in turn where an op
        loops inside vmap, several at once on threads."""
        self.chunk = CHUNK if cpu else DEVICE_CHUNK  #: workers per vmapped call
        self.loops_in_vmap = not cpu  #: vmap kept where an op has no batching rule (torch loops over the workers)
        self.copies = cpu  #: where workers are computed in turn, :attr:`threads` at once, a copy of the model each

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape, n in zip(self.names, self.shapes, self.numels):
            out[name] = flat[offset:offset + n].view(shape)
            offset += n
        return out

    def _call(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, {**self.views(flat), **self.buffers}, (x,))

    def _loss(self, flat: torch.Tensor, batch: Any) -> torch.Tensor:
        """The task's loss on ``batch``, the model holding ``flat``: ``step(model, batch).loss``, as a worker's."""
        named = {f"model.{k}": v for k, v in {**self.views(flat), **self.buffers}.items()}
        return functional_call(self.stepped, named, (batch,))

    def _one_pass(self, shards: Sequence[Any]) -> bool:
        """Whether the shards can run as one forward of their concatenation: pairs called by the convention's step
        (the model, then the loss on each shard's slice of the outputs); any other step is called shard by shard."""
        return calls_model_alone(self.step, self.model) and all(batches.is_pair(b) for b in shards)

    def mean(self, flat: torch.Tensor, shards: Sequence[Any], whole: Any = None) -> tuple[torch.Tensor, float]:
        """The mean of the workers' gradients on ``flat`` (one per batch) and their mean loss; ``whole``: the batch
        the shards were split from (sync's global batch), computed in one pass where that is their mean."""
        with self.using_threads():
            return self._mean(flat, shards, whole)

    def _mean(self, flat: torch.Tensor, shards: Sequence[Any], whole: Any) -> tuple[torch.Tensor, float]:
        leaf = flat.detach().requires_grad_(True)
        if self._one_pass(shards):
            out = self._call(leaf, torch.cat([b[0] for b in shards]))
            if type(out) is torch.Tensor:
                losses, start = [], 0
                for bx, by in shards:  # each shard's own mean loss, weighted 1/k: the mean of k gradients
                    losses.append(self.loss_fn(out[start:start + len(bx)], by))
                    start += len(bx)
                loss = functools.reduce(operator.add, losses) / len(shards)
                (g,) = torch.autograd.grad(loss, leaf)
                self.computed += len(shards)
                return g, float(loss.detach())
        self.computed += len(shards)
        key = getattr(self.step, "target_key", None)
        if whole is None or self.whole_is_mean is False or not _equal_counts(whole, shards, key):
            g, total = self._by_shard(leaf, shards)
            return g, float(total)
        loss = self._loss(leaf, whole)
        (g,) = torch.autograd.grad(loss, leaf)
        if self.whole_is_mean is None:  # the step's loss may be a sum, or weigh examples its own way: compare once
            mean, value = self._by_shard(leaf, shards)
            self.whole_is_mean = bool((g - mean).norm() <= 1e-4 * mean.norm())
            if not self.whole_is_mean:
                return mean, float(value)
        return g, float(loss.detach())

    def _by_shard(self, leaf: torch.Tensor, shards: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean gradient of the shards and their mean loss (a tensor: read back once, by the caller, so that on
        a GPU the shards' work queues up without waiting for each loss)."""
        g, total = torch.zeros_like(leaf), torch.zeros((), dtype=torch.float64, device=leaf.device)
        for shard in shards:  # one backward each: the memory of one shard's activations, not k
            loss = self._loss(leaf, shard) / len(shards)
            g += torch.autograd.grad(loss, leaf)[0]
            total = total + loss.detach().double()
        return g, total

    def each(self, flats, batches_: Sequence[Any]) -> tuple[torch.Tensor, list[float]]:
        """Each worker's gradient (row i of the result) on its own parameters and batch ``batches_[i]``.

        ``flats``: a (k, P) matrix of every worker's parameters (local copies), or a list of flat
        vectors, where workers on the same version hold the same tensor (versions are not copied
        into a stack when every worker of a chunk holds the same one)."""
        out = torch.empty(len(batches_), self.size, device=self.device)
        losses: list[float] = []
        with self.using_threads():
            for lo in range(0, len(batches_), self.chunk):
                hi = min(lo + self.chunk, len(batches_))
                losses += self._chunk(flats[lo:hi], batches_[lo:hi], out[lo:hi])
        self.computed += len(batches_)
        return out, losses

    @contextlib.contextmanager
    def using_threads(self, threads: Optional[int] = None) -> Iterator[None]:
        """torch's threads while gradients (and evaluations) are computed: :attr:`threads`. The simulation keeps
        fewer for its small element-wise updates, which threads that wait on busy cores slow down; a forward and
        backward of many examples gains from every core (1.47x on 2 cores: the GPT's whole batch of 64 workers,
        benchmarks/simulate_gradients.py)."""
        before = torch.get_num_threads()
        torch.set_num_threads(threads or self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _chunk(self, flats, chunk, out: torch.Tensor) -> list[float]:
        if self.vmappable is not False and len({batches.length(b) for b in chunk}) == 1:
            try:
                if isinstance(flats, torch.Tensor):
                    stacked, dims = flats.detach(), 0
                elif all(f is flats[0] for f in flats):
                    stacked, dims = flats[0].detach(), None
                else:
                    stacked, dims = torch.stack([f.detach() for f in flats]), 0
                # every tensor of the workers' batch trees stacked: one tree, each leaf (workers, ...)
                tree = pytree.tree_map(lambda *leaves: torch.stack(leaves), *chunk)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    g, values = vmap(grad_and_value(self._loss), in_dims=(dims, 0))(stacked, tree)
                # An op without a batching rule ran by torch's own loop inside vmap: right, and on the CPU slower
                # than one worker after another (the GPT example's attention: 741 ms for 64 workers, 430 ms in
                # turn), which the calls after this one do. On a GPU vmap stays: there the loop is that op's
                # kernels alone, one launch per worker, where in turn every op of every worker is launched.
                looped = [w for w in caught if "There is a performance drop" in str(w.message)]
                for w in caught:
                    if w not in looped:
                        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
                self.vmappable = not looped or self.loops_in_vmap
                out.copy_(g)
                return values.tolist()
            except Exception:  # the model or the step has no batching rule: one worker at a time
                if self.vmappable:
                    raise
                self.vmappable = False
        return self._in_turn(flats, chunk, out)

    def _in_turn(self, flats, chunk, out: torch.Tensor) -> list[float]:
        """One worker after another, each on its own parameters: on :attr:`threads` threads where there are
        several, each with a copy of the model of its own (``functional_call`` puts the parameters it is given
        into the module it calls), torch's own threads 1 meanwhile. Small gradients of a transformer gain
        little from torch's threads and much from computing several workers at once."""
        helpers = self._helpers()
        if len(helpers) == 1 or len(chunk) == 1:
            return _turns(self, flats, chunk, out, range(len(chunk)))
        k = len(helpers)
        with self.using_threads(1), ThreadPoolExecutor(k) as pool:
            parts = list(pool.map(lambda h: _turns(helpers[h], flats, chunk, out, range(h, len(chunk), k)), range(k)))
        losses = [0.0] * len(chunk)
        for h, values in enumerate(parts):
            losses[h::k] = values
        return losses

    def _helpers(self) -> list["Gradients"]:
        """This object and a copy per further thread, sharing its buffers (read only); itself alone where the
        model updates buffers in its forward (BatchNorm's statistics) or draws random numbers (dropout: threads
        would take them in no fixed order, and a run would not repeat), or cannot be copied."""
        if self.helpers is None:
            self.helpers = [self]
            alone = any((isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats)
                        or (isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0) for m in self.model.modules())
            if self.threads > 1 and not alone and self.copies:
                try:
                    for _ in range(self.threads - 1):
                        helper = Gradients(copy.deepcopy(self.model), self.loss_fn, self.step)
                        helper.buffers = self.buffers
                        self.helpers.append(helper)
                except Exception:  # a model deepcopy cannot copy: one thread
                    self.helpers = [self]
        return self.helpers


def _turns(grads: Gradients, flats, chunk, out: torch.Tensor, rows: range) -> list[float]:
    """Rows ``rows`` of ``out``: each worker's gradient on its own parameters and batch, with ``grads``' model."""
    losses = []
    for i in rows:
        leaf = flats[i].detach().requires_grad_(True)
        loss = grads._loss(leaf, chunk[i])
        out[i].copy_(torch.autograd.grad(loss, leaf)[0])
        losses.append(loss.detach())
    return torch.stack(losses).tolist() if losses else []  # read back once: a GPU's queue never waits on a loss


def _equal_counts(whole: Any, shards: Sequence[Any], key: Optional[str]) -> bool:
    """Whether a mean over ``whole``'s targets is the mean of the shards' means: shards as long, and no class
    target negative (an ignored one: ``-100``, nanoGPT's ``-1``), so each shard counts its length's share,
    shifted or not."""
    targets = batches.targets(whole, key)
    return (isinstance(targets, torch.Tensor) and len({batches.length(b) for b in shards}) == 1
            and (targets.is_floating_point() or not bool((targets < 0).any())))
