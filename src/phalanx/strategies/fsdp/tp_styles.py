"""How a planned layer is split: torch's ``ColwiseParallel`` / ``RowwiseParallel``, taught the transposed projection.

- ``nn.Linear`` and ``nn.Embedding``: torch's styles as they are.
- transformers' ``Conv1D`` (GPT-2; ``x @ weight + bias``, weight (in, out)) is an ``nn.Linear`` transposed: column-wise
  shards its weight on dim 1 and its bias on dim 0, row-wise its weight on dim 0 (bias whole); the forward is the
  module's own, run on DTensors, so the parameters keep their names and shapes and checkpoints stay the model's.
- a fused q,k,v projection (GPT-2's ``c_attn``) stays whole on every tp rank; each rank keeps its heads' slice of
  each third of the output (:class:`_KeepHeads`): forward a slice, backward the slices summed over the tp ranks
  (one all-reduce), so every rank's gradient of the whole projection is the full one.

An attention that keeps its head count, or the width it reshapes by, as an attribute sees this rank's share of
them (as torchtitan's and transformers' tensor parallelism set ``n_heads`` / ``num_heads`` per rank).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from .tp_plan import (BY_HEADS, COLWISE, FROM_WHOLE, FUSED, GATHERED, HEAD_ATTRIBUTES, KV_ATTRIBUTES, REPLICATED,
                      ROWWISE, transposed)

#: widths an attention reshapes by, made this rank's share with its heads (BERT, T5, GPT-2)
WIDTH_ATTRIBUTES = ("all_head_size", "inner_dim", "split_size")


def _placing(placements: dict[str, Placement]):
    def partition(_name: str, module: nn.Module, mesh) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, mesh, [placements[name]])
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    return partition


class Colwise(ColwiseParallel):
    """torch's ColwiseParallel; a transposed projection's weight sharded on dim 1, its bias on dim 0."""

    def _apply(self, module: nn.Module, device_mesh):
        if not transposed(module):
            return super()._apply(module, device_mesh)
        return distribute_module(module, device_mesh, _placing({"weight": Shard(1), "bias": Shard(0)}),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Rowwise(RowwiseParallel):
    """torch's RowwiseParallel; a transposed projection's weight sharded on dim 0, its bias whole."""

    def _apply(self, module: nn.Module, device_mesh):
        if not transposed(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh, _placing({"weight": Shard(0), "bias": Replicate()}),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class _KeepHeads(torch.autograd.Function):
    """This rank's 1/N of each of the 3 parts (q, k, v) of the last dim; backward: zeros elsewhere, summed over
    the tp ranks (each rank's heads are its own, so the sum is the whole gradient, the same on every rank)."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, rank: int, n: int, group) -> torch.Tensor:
        ctx.shape, ctx.rank, ctx.n, ctx.group = full.shape, rank, n, group
        return torch.cat([part.chunk(n, dim=-1)[rank] for part in full.chunk(3, dim=-1)], dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        whole = grad.new_zeros(ctx.shape)
        for part, mine in zip(whole.chunk(3, dim=-1), grad.chunk(3, dim=-1)):
            part.chunk(ctx.n, dim=-1)[ctx.rank].copy_(mine)
        dist.all_reduce(whole, group=ctx.group)
        return whole, None, None, None


def _keep_heads(mesh, module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
    return _KeepHeads.apply(output, mesh.get_local_rank(), mesh.size(), mesh.get_group())


def _style(kind: str) -> ParallelStyle:
    """torch's style for a planned layer. A layer kept whole (:data:`REPLICATED`, a per-head norm) is torch's
    SequenceParallel over the heads' dim: its parameters replicated DTensors, its input this rank's heads, so its
    gradient is a partial sum that DTensor adds up over the tp ranks."""
    styles: dict[str, Callable[[], ParallelStyle]] = {
        COLWISE: Colwise, ROWWISE: Rowwise, GATHERED: partial(Colwise, output_layouts=Replicate()),
        FROM_WHOLE: partial(Rowwise, input_layouts=Replicate()),
        REPLICATED: partial(SequenceParallel, sequence_dim=-2, use_local_output=True)}
    return styles[kind]()


def apply(block: nn.Module, plan: dict[str, str], mesh) -> None:
    """Split the block's planned layers over the tp mesh, in place; its attentions then count their local heads."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(block, mesh, {path: _style(kind) for path, kind in plan.items() if kind != FUSED})
    for path, kind in plan.items():
        if kind == FUSED:
            block.get_submodule(path).register_forward_hook(partial(_keep_heads, mesh))
    split = {path for path, kind in plan.items() if kind in BY_HEADS}  # (a gathered output keeps every head)
    for path, module in block.named_modules():
        prefix = f"{path}." if path else ""
        if any(p.startswith(prefix) for p in split) and any(hasattr(module, a) for a in HEAD_ATTRIBUTES):
            localise(module, mesh.size())


def localise(attention: nn.Module, n: int) -> None:
    """The attention's head counts and head widths, divided by the N ranks that share its heads."""
    for name in HEAD_ATTRIBUTES + KV_ATTRIBUTES + WIDTH_ATTRIBUTES:
        value = getattr(attention, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value % n == 0:
            setattr(attention, name, value // n)
