"""torch's ``PipelineStage``, less the side effects of its shape inference on the stage's buffers.

Why: the first time a schedule runs, the engine learns what each stage receives and sends by
running the stage once more than the schedule asks ("metadata inference", torch 2.13): the first
stage on micro-batch 0, every later stage on a tensor of the received shape made by
``torch.empty`` (whatever the memory held), in the module's current mode, then a backward to the
inputs. In training mode that extra forward is a real one, and a BatchNorm takes it into its
running statistics (measured on a digits CNN cut in two, after one step of 4 micro-batches:
``num_batches_tracked`` 5, ``running_var`` inf, ``running_mean`` -1.5e21; after 100 steps the
model tested at chance, 0.097 against sync's 0.964). torch already forks the random state around
it, so a Dropout draws nothing from the training run's stream.

:class:`Stage` puts the stage's buffers back as they were once the inference is over (after its
backward too: BatchNorm's backward reads the statistics it saved, so they cannot change before),
runs it on zeros instead of uninitialised memory (an integer input becomes valid indices, and no
NaN or inf goes through a layer), and on a copy of micro-batch 0 (a first layer that works in
place must not change the batch before the real pass). The schedule's own passes are untouched:
what a step computes is the engine's.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

Saved = list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]


def save_buffers(module: nn.Module) -> Saved:
    """Every buffer of ``module``: (owner, name, the tensor, a copy of its values)."""
    return [(owner, name, buffer, buffer.detach().clone())
            for owner in module.modules() for name, buffer in owner.named_buffers(recurse=False)]


def restore_buffers(saved: Saved) -> None:
    """Give every owner back its buffer: the same tensor (a module may have replaced it rather than
    updated it), holding the saved values."""
    with torch.no_grad():
        for owner, name, buffer, value in saved:
            setattr(owner, name, buffer)
            buffer.copy_(value)


class Stage(PipelineStage):
    """A ``PipelineStage`` whose shape inference leaves the stage's buffers as it found them (see the
    module docstring). Built and driven exactly as torch's."""

    _before_inference: Optional[Saved] = None

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        self._save_once()
        return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        self._save_once()
        return super()._prepare_backward_infra(*args, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        """The engine calls this once the forward and backward inference are both over."""
        super()._post_metadata_inference_cleanup()
        if self._before_inference is not None:
            restore_buffers(self._before_inference)
            self._before_inference = None

    def _save_once(self) -> None:
        if self._before_inference is None:
            self._before_inference = save_buffers(self.submod)

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        if isinstance(arg, torch.Tensor):
            return arg.detach().clone().requires_grad_(arg.requires_grad)
        made = super()._to_tensor(arg)
        with torch.no_grad():
            made.zero_()
        return made
