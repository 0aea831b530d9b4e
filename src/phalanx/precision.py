"""Mixed precision and compilation, for every strategy alike.

``--precision bf16|fp16`` runs each forward pass (and the loss) under ``torch.autocast``: matrix
products in half precision, reductions and the loss in fp32. Parameters, gradients, optimizer
state and checkpoints stay fp32. fp16 needs a gradient scaler (its range is too small for small
gradients) and is offered on CUDA only; bf16 has fp32's range and needs none.

``--compile`` compiles the model in place (``Module.compile``), so the parameter names stay the
same (checkpoints load into an uncompiled model). Where the strategy runs the model as one piece
with no communication inside its backward (one worker, local SGD, DiLoCo, the parameter server's
family, Hogwild!), the model is compiled whole, as a user's ``torch.compile(model)`` is; else each
block is compiled alone: DDP, FSDP and the pipeline stages hold the compiled blocks as they would
the eager ones, and a strategy that splits the model splits it at block boundaries, so every piece
is compiled. What a 99 M-parameter GPT gains from the whole: benchmarks/gpu/gpt_speed.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from .task.models import model_blocks_by_default

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NO_AUTOCAST = contextlib.nullcontext()  #: fp32's, made once (a null context is reusable): a step makes none


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str = "fp32"
    device_type: str = "cpu"

    def autocast(self) -> contextlib.AbstractContextManager:
        """Around a forward pass and its loss (never around backward)."""
        if self.name == "fp32":
            return _NO_AUTOCAST
        return torch.autocast(self.device_type, dtype=_DTYPES[self.name])

    def sharded_policy(self) -> Optional[Any]:
        """fsdp's ``mp_policy`` for ``fully_shard`` (None: none). bf16 on a GPU: each unit's parameters are
        gathered and computed with in bf16 (half the all-gather bytes), gradients reduce-scattered in fp32, the
        sharded parameters and the optimizer stay fp32 (torch's ``MixedPrecisionPolicy``, as torchtitan sets
        it). On a CPU nothing changes: autocast alone, as every strategy has it (a CPU without bf16
        instructions computes bf16 slower)."""
        if self.name != "bf16" or self.device_type != "cuda":
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def scaler(self) -> Optional[torch.amp.GradScaler]:
        """fp16's gradient scaler (None for bf16 and fp32, which need none)."""
        return torch.amp.GradScaler(self.device_type) if self.name == "fp16" else None

    def around_forward(self, module: nn.Module) -> None:
        """Make ``module``'s own forward run under autocast, for engines that call it themselves
        (a pipeline schedule runs forward and backward interleaved: the context cannot wrap one
        without the other). Its outputs come back in fp32, as the next stage and the loss expect."""
        if self.name == "fp32":
            return
        contexts: list = []

        def enter(mod, args):
            contexts.append(self.autocast())
            contexts[-1].__enter__()

        def leave(mod, args, out):
            contexts.pop().__exit__(None, None, None)
            return out.float() if torch.is_tensor(out) and out.is_floating_point() else out

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The units compiled one by one: the model's ``pipeline_blocks()``, else its top-level children (which
    cover the whole model, where fsdp's repeated blocks leave the embeddings and head out), or the model itself
    if it has none."""
    return [m for _, m in model_blocks_by_default(model)] or [model]


def compile_model(model: nn.Module, whole: bool) -> str:
    """Compile ``model`` in place, whole or block by block; says what was compiled."""
    if whole:
        model.compile()
        return "the whole model"
    units = blocks(model)
    for unit in units:
        unit.compile()
    return f"{len(units)} blocks, each"
