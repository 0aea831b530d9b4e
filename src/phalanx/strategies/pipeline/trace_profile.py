"""The time profiler for a model split by tracing: forward+backward seconds per micro-batch of every piece.

The pieces are what lies between consecutive candidate split points (``trace.py``): the step is
traced once with a split at every candidate, and the pieces are run one after another as the
root of that split graph runs them, each timed on its own (its inputs fresh leaves, so its
backward stops there; the gradients a piece's outputs receive are handed back by hand, summed
where several later pieces read one value). It is the block profiler of ``profile.py`` for pieces
that take and give any number of values, under the same conditions: every rank times at once
(``barrier``), warm, in the schedule's order, on a private copy of the model (its buffers, such as
BatchNorm's statistics, and its gradients are the profiler's), under a forked random state.
"""

from __future__ import annotations

import copy
import operator
import statistics
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from .profile import BlockTimes, _now
from .trace import Traced, flat_tensors


def time_pieces(model: nn.Module, step: Callable, micro: Sequence[Any], points: Sequence[str],
                device: torch.device, repeats: int = 5, *, schedule: str = "gpipe", warmup: int = 1,
                barrier: Optional[Callable[[], None]] = None) -> BlockTimes:
    """This rank's median forward+backward seconds per micro-batch of each of the ``len(points) + 1`` pieces."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        twin = copy.deepcopy(model).train()
        traced = Traced(twin, step, micro[0], points, len(points) + 1)
        runner = _Pieces(traced)
        inputs = [flat_tensors(batch)[0] for batch in micro]
        passes = []
        for _ in range(warmup + repeats):
            if barrier is not None:
                barrier()
            seconds = [0.0] * runner.count
            if schedule == "gpipe":
                for record in [runner.forward(x, device, seconds) for x in inputs]:
                    runner.backward(record, device, seconds)
            else:
                for x in inputs:
                    runner.backward(runner.forward(x, device, seconds), device, seconds)
            twin.zero_grad(set_to_none=True)
            passes.append([s / len(inputs) for s in seconds])
    timed = passes[warmup:]
    return BlockTimes([statistics.median(p[i] for p in timed) for i in range(runner.count)], runner.sizes)


class _Pieces:
    """The split graph's pieces, run one by one: which value each piece reads from which piece."""

    def __init__(self, traced: Traced):
        graph = traced.pipe.split_gm.graph
        self.gm, self.traced = traced.pipe.split_gm, traced
        self.nodes = [n for n in graph.nodes if n.op == "call_module"]
        self.count = len(self.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.sizes = [0] * self.count  #: bytes each piece sends on per micro-batch (filled by the first forward)

    def _source(self, node: Any) -> tuple[Any, Optional[int]]:
        """(the piece node, output index or None) a root-graph value comes from; (node, None) for an input."""
        if node.op == "call_function" and node.target is operator.getitem:
            return node.args[0], int(node.args[1])
        return node, None

    def forward(self, tensors: list[torch.Tensor], device: torch.device, seconds: list[float]) -> list:
        inputs = iter(t.to(device) for t in tensors)
        values: dict[Any, Any] = {}
        record = []
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                values[node] = next(inputs)
            elif node.op == "call_module":
                leaves = []
                for arg in node.args:
                    value = self._value(values, arg)
                    leaf = value.detach().requires_grad_(value.is_floating_point())
                    leaves.append((self._source(arg), leaf))
                start = _now(device)
                out = self.gm.get_submodule(node.target)(*[leaf for _, leaf in leaves])
                seconds[self.index[node]] += _now(device) - start
                values[node] = out
                record.append((node, leaves, out))
                for (source, _), leaf in leaves:
                    if source in self.index and not self.sizes[self.index[source]]:
                        self.sizes[self.index[source]] = leaf.nelement() * leaf.element_size()
        return record

    def _value(self, values: dict, arg: Any) -> Any:
        source, k = self._source(arg)
        return values[source] if k is None else values[source][k]

    def backward(self, record: list, device: torch.device, seconds: list[float]) -> None:
        """Last piece first: its loss; every other, the gradients its outputs' readers left on their leaves."""
        grads: dict[tuple, torch.Tensor] = {}
        for node, leaves, out in reversed(record):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if node is self.nodes[-1]:
                pairs: list[tuple[Any, Optional[torch.Tensor]]] = [(outs[self.traced.positions[0]], None)]
            else:
                keys = [(node, k if isinstance(out, (tuple, list)) else None) for k in range(len(outs))]
                pairs = [(o, grads[key]) for o, key in zip(outs, keys) if key in grads and o.requires_grad]
            start = _now(device)
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs] if pairs[0][1] is not None
                                        else None)
            seconds[self.index[node]] += _now(device) - start
            for source, leaf in leaves:
                if leaf.grad is not None:
                    grads[source] = grads[source] + leaf.grad if source in grads else leaf.grad
