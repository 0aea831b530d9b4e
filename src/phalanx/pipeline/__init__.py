"""Pipeline model parallelism: split the network into stages, balance them, pipeline micro-batches.

- ``balance.py``: the exact partition of per-block costs into contiguous stages; predicted bubble;
- ``split.py``: a model's blocks (``nn.Sequential`` or ``pipeline_blocks()``), one stage's module;
- ``profile.py``: forward+backward time per block, measured on the device;
- ``plan.py``: the chosen plan as printed;
- ``state.py``: one whole-model checkpoint from the stages' pieces, and back;
- ``strategy.py``: the :class:`Pipeline` strategy (``torch.distributed.pipelining`` is the engine).
"""

from .balance import partition, predicted_bubble
from .plan import StagePlan
from .split import StageModule, model_blocks
from .strategy import Pipeline

__all__ = ["Pipeline", "StageModule", "StagePlan", "model_blocks", "partition", "predicted_bubble"]
