"""torch's ``PipelineStage`` in its static mode: a stage's input and output, worked out without running it.

Why: a ``PipelineStage`` built without examples learns what it receives and sends on its
schedule's first step by running the stage once more than the schedule asks (torch 2.13's
"metadata inference"): every later stage on a ``torch.empty`` tensor of the received shape, in
the module's current mode, then a backward. In training mode that is a real forward, and a
BatchNorm took it into its running statistics (a digits CNN cut in two, after one step of 4
micro-batches: ``num_batches_tracked`` 5, ``running_var`` inf; after 100 steps it tested at
chance, 0.097 against sync's 0.964). Given ``input_args`` and ``output_args`` (plain tensors, no
DTensor), torch runs no such pass at all: it sizes its receive buffers from the examples, and a
step runs the micro-batches and nothing else (``PipelineStage``'s docstring, and
``InferenceMode.needs_dynamic`` in ``torch/distributed/pipelining/_utils.py``).

How: :func:`stage_examples` runs the stages up to this one on one micro-batch as the schedule
will, each stage's output handed to the next as the engine hands it (a fresh leaf that requires
grad where the output does), in this stage's mode and grad mode. It runs them on the "meta"
device: the real modules, their parameters and buffers swapped for meta tensors of the same
shape and dtype for the call (``torch.func.functional_call``), so nothing is computed or
allocated and the real buffers cannot change. A forward that cannot run on meta tensors (it
reads a value with ``.item()``, or makes a tensor on the CPU) runs for real instead, on a copy
of the micro-batch and of the buffers: exact too, at the price of one forward. Either way the
random state is forked (a Dropout draws nothing from the training run's stream) and compiled
blocks run eagerly (compiling for meta tensors is slow and useless).

The examples hold for one micro-batch shape: the runtime builds a stage per shape it is fed
(``runtime.py``).
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.func import functional_call


def static_stage(stages: Sequence[nn.Module], index: int, num_stages: int, device: torch.device,
                 group: Optional[dist.ProcessGroup], micro_batch: torch.Tensor, backward: bool) -> PipelineStage:
    """A ``PipelineStage`` for ``stages[index]`` that runs no shape inference: its examples come
    from :func:`stage_examples` (``stages`` holds at least the stages up to ``index``)."""
    inputs, outputs = stage_examples(stages[: index + 1], micro_batch, device, backward)
    return PipelineStage(stages[index], index, num_stages, device, input_args=inputs, output_args=outputs,
                         group=group)


def stage_examples(stages: Sequence[nn.Module], micro_batch: torch.Tensor, device: torch.device,
                   backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of the last of ``stages`` for one micro-batch, as meta tensors carrying the
    shape, stride, dtype and ``requires_grad`` the engine needs. The stages run in the last one's
    mode, with gradients where the schedule has a backward; the real modules keep their buffers."""
    modes = [(m, m.training) for stage in stages for m in stage.modules()]
    forked = [device] if device.type != "cpu" else []
    try:
        for stage in stages:
            stage.train(stages[-1].training)
        with torch.random.fork_rng(devices=forked, device_type=device.type), \
                torch.compiler.set_stance("force_eager"), torch.set_grad_enabled(backward):
            try:
                inp, out = _through(stages, micro_batch.to("meta"), meta=True)
            except Exception:  # no meta kernel, a CPU tensor, a value read: the real thing on copies
                inp, out = _through(stages, micro_batch.to(device).clone(), meta=False)
    finally:
        for module, training in modes:
            module.training = training
    return _as_meta(inp), _as_meta(out)


def _through(stages: Sequence[nn.Module], x: torch.Tensor, meta: bool) -> tuple[torch.Tensor, torch.Tensor]:
    inp = x
    for i, stage in enumerate(stages):
        # The first stage gets the micro-batch itself; a later one, a leaf like the engine's receive buffer.
        inp = x if i == 0 else x.detach().requires_grad_(x.requires_grad)
        x = functional_call(stage, _stand_ins(stage, meta), (inp,))
    return inp, x


def _stand_ins(module: nn.Module, meta: bool) -> dict[str, torch.Tensor]:
    """What the call uses in place of the module's own tensors: meta tensors alike, or (for a real
    run) copies of the buffers, which a forward may update in place (BatchNorm's statistics)."""
    if not meta:
        return {name: buffer.clone() for name, buffer in module.named_buffers()}
    return {name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
            for name, t in itertools.chain(module.named_parameters(), module.named_buffers())}


def _as_meta(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("meta").requires_grad_(t.requires_grad)
