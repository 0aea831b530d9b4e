"""Pipeline engine helpers: split a network into stages, balance them, checkpoint the pieces.

The :class:`~phalanx.strategies.pipeline.Pipeline` strategy builds on these; none of them knows
about strategies (``torch.distributed.pipelining`` runs the schedule).

- ``balance.py``: the exact partition of per-block costs (and per-cut message costs) into
  contiguous stages; the predicted step and bubble;
- ``split.py``: a model's blocks (``nn.Sequential`` or ``pipeline_blocks()``), one stage's module;
- ``trace.py``: a model as written: its training step traced by torch.export and split at named points
  (torch's tracing front end), the default points between repeated blocks;
- ``traced.py``: one rank's traced stage, and the tied parameters whose gradients its stages sum;
- ``profile.py``: forward+backward time per block, measured in the workers as their stages run;
- ``messages.py``: one-way time of a boundary's message between neighbouring stages;
- ``plan.py``: the chosen plan as printed, and what it (or any other partition) predicts;
- ``schedule.py``: GPipe with its receives posted ahead (torch's ``ScheduleGPipe`` otherwise);
- ``stage.py``: torch's ``PipelineStage`` in its static mode, its examples worked out on meta tensors;
- ``state.py``: one whole-model checkpoint from the stages' pieces, and back.
"""

from .balance import partition, predicted_bubble
from .plan import StagePlan
from .split import StageModule, model_blocks

__all__ = ["StageModule", "StagePlan", "model_blocks", "partition", "predicted_bubble"]
