"""Turning a model into blocks, and blocks into one stage's module.

A model can be split if it says what its blocks are, in forward order:

- an ``nn.Sequential``: its children are the blocks (nest Sequentials to make coarser blocks);
- any module with a ``pipeline_blocks()`` method returning its blocks (submodules) in the order
  its forward applies them, each block's output being the next block's input.

Every parameter and buffer of the model must live in exactly one block: the pipeline runs the
blocks, never the model's own ``forward``, so anything outside them would silently not train.

A :class:`StageModule` holds one stage's blocks under their names in the whole model, so its
:meth:`~StageModule.full_state_dict` uses the unsplit model's keys (``"2.lstm.weight_ih_l0"``)
and the stages' dicts together are exactly ``model.state_dict()``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ...errors import PhalanxError


def model_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name in the model, block) for every block, in forward order; a clear error otherwise."""
    if hasattr(model, "pipeline_blocks"):
        blocks = list(getattr(model, "pipeline_blocks")())  # (the model's own method: nn.Module declares none)
        names = {id(m): name for name, m in model.named_modules() if name}
        missing = [type(b).__name__ for b in blocks if id(b) not in names]
        if missing:
            raise PhalanxError(f"{type(model).__name__}.pipeline_blocks() returned modules that are not submodules of "
                               f"the model ({', '.join(missing)}); return the model's own blocks")
        named = [(names[id(b)], b) for b in blocks]
    elif isinstance(model, nn.Sequential):
        named = [(name, m) for name, m in model._modules.items() if m is not None]  # keeps repeats
    else:
        raise PhalanxError(
            f"{type(model).__name__} has no sequential structure to split into stages: make it an nn.Sequential of "
            "blocks, or give it a pipeline_blocks() method returning its blocks in forward order"
        )
    if not named:
        raise PhalanxError(f"{type(model).__name__} has no blocks to split: give it at least one")
    _check_covered(model, named)
    return named


def has_blocks(model: nn.Module) -> bool:
    """Whether the model says what its blocks are (an nn.Sequential, or ``pipeline_blocks()``) and no two
    blocks share a parameter: then a pipeline cuts it at its blocks; otherwise it traces it (``trace.py``)."""
    if not (hasattr(model, "pipeline_blocks") or isinstance(model, nn.Sequential)):
        return False
    blocks = list(getattr(model, "pipeline_blocks")()) if hasattr(model, "pipeline_blocks") else list(model.children())
    params = [id(p) for block in blocks for p in block.parameters()]
    return len(set(params)) == len(params)


def blocks_or_whole(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """:func:`model_blocks` where the model has a sequential structure; else the whole model as one
    block (what a cost needs of any model: a data-parallel strategy never splits it)."""
    if hasattr(model, "pipeline_blocks") or isinstance(model, nn.Sequential):
        return model_blocks(model)
    return [(type(model).__name__, model)]


def _check_covered(model: nn.Module, named: list[tuple[str, nn.Module]]) -> None:
    if len({id(b) for _, b in named}) != len(named):
        raise PhalanxError(f"{type(model).__name__} lists one block twice: each block must appear once")
    params = [id(p) for _, block in named for p in block.parameters()]
    if len(set(params)) != len(params):
        raise PhalanxError(f"{type(model).__name__} shares parameters between blocks (tied weights): a cut at its "
                           "blocks cannot share a tensor; give --split-points to split it by tracing, which keeps "
                           "tied weights tied")
    covered = {f"{name}.{key}" for name, block in named for key in block.state_dict()}
    outside = [key for key in model.state_dict() if key not in covered]
    if outside:
        shown = ", ".join(outside[:4]) + (" ..." if len(outside) > 4 else "")
        raise PhalanxError(f"{type(model).__name__} has parameters outside its blocks ({shown}): a pipeline runs only "
                           "the blocks, so move them into a block")


def parameter_counts(blocks: Sequence[nn.Module]) -> list[int]:
    return [sum(p.numel() for p in block.parameters()) for block in blocks]


class _ContiguousGrad(torch.autograd.Function):
    """A copy forward; makes the incoming gradient contiguous.

    Why the gradient: the engine sends a stage's input gradient to the previous stage, which
    receives it into a buffer laid out like that gradient (same strides); gloo refuses
    non-contiguous buffers, and many layers (an LSTM with ``batch_first``) produce transposed
    gradients. Why a copy: the stage's input is the engine's receive buffer, a leaf that requires
    grad, and a first layer that works in place (torchvision's ``ReLU(inplace=True)``) must be
    able to, as it can on the unsplit model's intermediate tensor; a view (of the leaf, or one
    made inside a custom Function) refuses in-place ops. One activation copy per micro-batch.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class StageModule(nn.Module):
    """One stage: a run of the model's blocks, applied in order.

    Its inputs and outputs travel between processes, so both the output and the gradient of the
    input are made contiguous (see :class:`_ContiguousGrad`).
    """

    def __init__(self, named_blocks: Sequence[tuple[str, nn.Module]]):
        super().__init__()
        self.names = [name for name, _ in named_blocks]
        self.blocks = nn.ModuleList(block for _, block in named_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:
            x = _ContiguousGrad.apply(x)
        for block in self.blocks:
            x = block(x)
        return x.contiguous()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers under the unsplit model's keys (CPU copies)."""
        return {f"{name}.{key}": value.detach().cpu()
                for name, block in zip(self.names, self.blocks) for key, value in block.state_dict().items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take this stage's part of a whole model's ``state_dict``."""
        for name, block in zip(self.names, self.blocks):
            prefix = f"{name}."
            part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            try:
                block.load_state_dict(part)
            except RuntimeError as e:
                raise PhalanxError(
                    f"checkpoint does not fit block {name!r} of this model ({str(e).splitlines()[0][:160]}); "
                    "resume with the --model and data the checkpoint was trained with"
                ) from None

    def extra_repr(self) -> str:
        return f"blocks {', '.join(self.names)}"
