"""Pipeline engine helpers: split a network into stages, balance them, checkpoint the pieces.

The :class:`~phalanx.strategies.pipeline.Pipeline` strategy builds on these; none of them knows
about strategies (``torch.distributed.pipelining`` runs the schedule).

- ``balance.py``: the exact partition of per-block costs into contiguous stages; predicted bubble;
- ``split.py``: a model's blocks (``nn.Sequential`` or ``pipeline_blocks()``), one stage's module;
- ``profile.py``: forward+backward time per block, measured on the device;
- ``plan.py``: the chosen plan as printed;
- ``state.py``: one whole-model checkpoint from the stages' pieces, and back.
"""

from .balance import partition, predicted_bubble
from .plan import StagePlan
from .split import StageModule, model_blocks

__all__ = ["StageModule", "StagePlan", "model_blocks", "partition", "predicted_bubble"]
