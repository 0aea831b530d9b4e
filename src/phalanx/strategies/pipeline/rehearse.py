"""A pipeline's first step, rehearsed in the parent: the training step traced and split as the workers will split
it, then run through every stage in turn (forward and backward) on the example batch, on a copy of the model. What
would crash in a stage (a traced graph that cannot carry what a block returns) is one line before any worker starts.
"""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Any, Callable

import torch
from torch import nn

from ...errors import PhalanxError
from .trace import Traced, candidate_points, flat_tensors
from .trace_profile import _Pieces

#: a model larger than this (elements) is not copied for a rehearsal in the parent (the workers will tell)
REHEARSAL_LIMIT = 1 << 26


def rehearse(model: nn.Module, points: tuple[str, ...], example: Any, step: Callable) -> None:
    """Trace at ``points`` (none given: at every repeated block, which covers any split the balance chooses) and
    run the split graph piece after piece, each on detached inputs as a stage receives them, then backward from
    the loss (``trace_profile``'s runner: what balancing by time runs in the workers)."""
    points = points or tuple(candidate_points(model))
    if not points or sum(p.numel() for p in model.parameters()) > REHEARSAL_LIMIT:
        return
    with torch.random.fork_rng():
        twin = copy.deepcopy(model).train()
        traced = Traced(twin, step, example, points, len(points) + 1)  # (its own failure: one line already)
        try:  # (torch.fx prints a failing piece's generated code; the one line below says it)
            with contextlib.redirect_stderr(io.StringIO()):
                _run(traced, example, len(points) + 1)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise PhalanxError(f"--strategy pipeline: {type(model).__name__} split at {', '.join(points[:4])}"
                               f"{' ...' if len(points) > 4 else ''} fails in its first step ({type(e).__name__}: "
                               f"{first}); name other --split-points (where a block's whole output is the next "
                               "one's input), or choose another --strategy") from None


def _run(traced: Traced, example: Any, pieces: int) -> None:
    runner, cpu, seconds = _Pieces(traced), torch.device("cpu"), [0.0] * pieces
    runner.backward(runner.forward(flat_tensors(example)[0], cpu, seconds), cpu, seconds)
