"""Sharded data parallelism: torch's ``fully_shard`` (FSDP2) is the engine.

Every rank trains on its own shard of the batch, as with ``sync``, but no rank keeps a whole
replica: each parameter (a :class:`~torch.distributed.tensor.DTensor` sharded on dim 0 over a
1-D device mesh of all ranks) lives 1/W on each rank, and so do its gradient and its optimizer
state, because the optimizer only ever sees the local shards. Each block of the model is one
unit of communication:

- forward: before a block runs, its parameters are all-gathered (one collective per block);
  after it, they are freed again (``--reshard-after-forward``, the default) or kept until backward;
- backward: the block's parameters are all-gathered again (when they were freed), its gradients
  computed, then reduce-scattered: every rank receives the average over ranks of its own shard;
- the optimizer steps on the local shards only; nothing else moves.

So W workers with batch B compute what one process computes with batch W·B (the equivalence
test checks this in float64 for SGD and Adam on 2 and 3 ranks), while each rank holds about 1/W
of the parameters, gradients and optimizer state, plus one gathered block at a time.

Blocks are the model's own structure: an ``nn.Sequential``'s children (every built-in model), a
``pipeline_blocks()`` method's modules, any other model's repeated blocks (the modules of one class that
a ``ModuleList`` or ``Sequential`` repeats: a transformer's layers; the rest stays with the root), else
its top-level children; or the submodules or classes named in ``FSDP(blocks=...)`` / ``--blocks``. A
model with no block holding parameters is refused. ``--precision bf16`` on a GPU gives every unit torch's
``MixedPrecisionPolicy`` (bf16 parameters in compute, fp32 reduce-scatter).

Checkpoints are sharded: every rank saves its own shards of the parameters and the optimizer state
with torch's distributed checkpoint (``get_state_dict`` with sharded state dicts, ``dcp.save``; see
``checkpoint/dcp.py``), and no rank gathers the whole model. Loading reads each rank's part of every
tensor, whatever worker count wrote it (DCP reshards); ``sync``, one process and ``phalanx
evaluate`` read the whole. A single-file checkpoint (sync's, a pipeline's, a plain model's) loads
too: every rank takes its shard of the full state dict. :meth:`FSDPRuntime.state_dict` still gives
the full model and optimizer state, gathered to rank 0 in a plain optimizer's numbering.

Buffers (BatchNorm's running statistics) are not sharded and never synced by ``fully_shard``: each
rank's move with its own batches. An evaluation first gives every rank rank 0's (DDP's rule, and what
the checkpoint holds), so every part of the test set is evaluated by the saved model.

One process (world size 1) runs the plain model, with no process group and nothing to shard.

Here: the options, their layout and the registration. The runtime is ``runtime.py``; the units to shard,
``units.py``; the optimizer state's numberings, ``state.py``; tensor parallelism, ``tensor_parallel.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterable, Optional, Union

from torch import nn

from ...errors import PhalanxError
from ...options import option
from ...simulate import LOCKSTEP
from .. import meta_init
from ..base import Build, Runtime
from ..options import Options, require_positive
from ..layout import Job, Layout, data_parallel
from ..registry import register
from . import tensor_parallel
from .costs import FSDPCost
from .runtime import FSDPRuntime
from .units import shard_units


def parse_blocks(value: Union[str, Iterable[str]]) -> tuple[str, ...]:
    """``"encoder,decoder"`` or ``["Block"]`` -> a tuple of submodule or class names."""
    given = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(n).strip() for n in given if str(n).strip())
    if not names:
        raise PhalanxError("--blocks names no submodule: give names like 'encoder,decoder' or a class like 'Block', "
                           "or leave it out")
    return names


@dataclasses.dataclass(frozen=True)
class FSDP(Options):
    """Shard parameters, gradients and optimizer state over the workers (FSDP2)."""

    name: ClassVar[str] = "fsdp"
    checkpoints_activations: ClassVar[bool] = True
    summary: ClassVar[str] = ("sharded data parallelism: parameters, gradients and optimizer state split over the "
                              "workers, gathered block by block; torch's fully_shard (FSDP2)")
    sharded_checkpoints: ClassVar[bool] = True

    reshard_after_forward: bool = option(True, "free each block's gathered parameters after its forward and gather "
                                               "them again for backward (less memory, one more all-gather per block)")
    blocks: Optional[tuple[str, ...]] = option(None, "the modules sharded as units: submodule names as "
                                                     "named_modules() gives them (e.g. 'encoder,head') or class "
                                                     "names, every module of that class (e.g. 'Block')",
                                               parse=parse_blocks, show="the model's repeated blocks")
    init_device: Optional[str] = option(None, "'meta': every worker builds the model on the meta device (no memory) "
                                              "and materialises it one block at a time, keeping its shard of each",
                                        choices=("meta",), show="the worker's device")
    init_weights: Optional[Any] = option(None, "with --init-device meta: MODULE:CALLABLE, a function of one module "
                                               "that initialises its own tensors (called on each as model.apply(fn) "
                                               "calls it, after its reset_parameters())", show="reset_parameters()")
    tensor_parallel: int = option(1, "split each block's attention and MLP Linear layers over N ranks (column- then "
                                     "row-wise, DTensor's parallelize_module); N divides the workers: a 2-D mesh "
                                     "(workers/N fsdp x N tensor-parallel)")

    def __post_init__(self) -> None:
        if not isinstance(self.reshard_after_forward, bool):
            raise PhalanxError(f"--reshard-after-forward is on or off, got {self.reshard_after_forward!r}")
        if self.blocks is not None:
            self._set(blocks=parse_blocks(self.blocks))
        if self.init_device not in (None, "meta"):
            raise PhalanxError(f"--init-device {self.init_device}: only 'meta' is known (build nothing, materialise "
                               "each rank's shards), or leave it out")
        if self.init_weights is not None and self.init_device != "meta":
            raise PhalanxError("--init-weights initialises a model built on the meta device: add --init-device meta")
        require_positive("--tensor-parallel", self.tensor_parallel)

    def builds_on_meta(self) -> bool:
        return self.init_device == "meta"

    def init_fn(self) -> Optional[meta_init.InitFn]:
        """The --init-weights function (an import path is resolved where it is asked for: parent and workers)."""
        if isinstance(self.init_weights, str):
            from ...task import resolve  # (the task layer: how a user's import path is found)

            return resolve(self.init_weights, "--init-weights", "a function of one module that initialises it")
        return self.init_weights

    def layout(self, job: Job) -> Layout:
        if self.tensor_parallel > 1:
            tensor_parallel.check_degree(self.tensor_parallel, job.processes or job.workers)
        if job.model is not None:  # refuse a model with nothing to shard (or to split) before anything starts
            units = shard_units(job.model, self.blocks)
            if self.builds_on_meta():
                meta_init.check_initialisable(job.model, self.init_fn())
            if self.tensor_parallel > 1:
                tensor_parallel.model_plan(job.model, units, self.tensor_parallel)
        if self.tensor_parallel > 1:
            return tensor_parallel.layout(job, self.tensor_parallel)
        return data_parallel(job)

    def rehearse(self, model: nn.Module, example: Any, step: Any) -> None:
        if self.tensor_parallel > 1 and not self.builds_on_meta():
            tensor_parallel.rehearse(model, self.blocks, self.tensor_parallel, example, step)

    def describe(self) -> str:
        how = "fully_shard" if self.reshard_after_forward else "fully_shard, no reshard after forward"
        extra = f" x tensor parallel {self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return f"fsdp ({how}{extra}{', built on meta' if self.builds_on_meta() else ''})"

    def runtime(self, build: Build) -> Runtime:
        return FSDPRuntime(build, self)

    def units(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return shard_units(model, self.blocks)


# Its cost model, for phalanx estimate (costs.py); each step computes what sync computes: simulated as sync
# (simulate/lockstep.py), timed as fsdp.
register(FSDP, cost=FSDPCost(), simulated=LOCKSTEP)


__all__ = ["FSDP", "parse_blocks", "shard_units"]
