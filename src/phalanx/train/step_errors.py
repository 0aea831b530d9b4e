"""A training step's failure inside a worker whose cause is known, said in one line that names the fix (exit 2).

Anything else keeps its traceback: it is a bug, in phalanx or in the model, not bad input.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ..errors import PhalanxError

#: what DTensor's dispatch says when an operator is given a sharded parameter and a plain tensor together
MIXED = "got mixed torch.Tensor and DTensor"


def explained(error: BaseException, model: nn.Module) -> Optional[PhalanxError]:
    """The one line for ``error`` where its cause is known (None: not known, let it keep its traceback).

    Mixed tensors: outside its block's forward a sharded parameter is its shard, a DTensor, so a tensor made
    from it there (pytorch/examples' ``init_hidden``: ``next(self.parameters()).new_zeros(...)``, called in the
    model's own forward) is a DTensor too, and the next operator of a block meets it beside its gathered, plain
    parameters. torch says only ``aten.mkldnn_rnn_layer.default got mixed torch.Tensor and DTensor``.
    """
    text = str(error)
    if not isinstance(error, RuntimeError) or MIXED not in text:
        return None
    op = text.split(MIXED)[0].strip() or "an operator"
    first = next((name for name, _ in model.named_parameters()), "the first parameter")
    owner = first.rpartition(".")[0] or "the module holding it"
    return PhalanxError(
        f"the model's forward gave {op} a sharded parameter's tensor (a DTensor) beside plain ones: state built "
        f"from a parameter outside the forward of the block that holds it is a shard, e.g. "
        f"next(self.parameters()).new_zeros(...) in an init_hidden (next(self.parameters()) is {first}); build it "
        f"from the input instead (x.new_zeros(...)), or leave {owner} out of --blocks so that it stays with the "
        "root, gathered for the whole forward")
