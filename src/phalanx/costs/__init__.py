"""The cost model: pure functions from measured compute, the model's sizes and the network to a step time.

- ``inputs.py``: :class:`Compute` (a worker's measured step), :class:`ModelFacts` (sizes),
  :class:`Network` (links, workers per node) and the collectives' α–β costs;
- ``timeline.py``: compute and communication streams, and what overlaps;
- one module per strategy: ``sync.py`` (DDP buckets overlapping backward), ``ps.py`` (an event
  simulation of workers and the server), ``local_sgd.py``, ``pipeline.py``, ``fsdp.py``;
- ``prediction.py``: :class:`Prediction`, one row of the report.
"""

from .fsdp import predict_fsdp
from .inputs import Compute, ModelFacts, Network, allreduce, gather_or_scatter
from .local_sgd import predict_local_sgd
from .pipeline import predict_pipeline, stage_plan
from .prediction import Prediction
from .ps import predict_ps, simulate, steady_state
from .sync import predict_sync
from .timeline import Op, finish, schedule

__all__ = ["Compute", "ModelFacts", "Network", "Op", "Prediction", "allreduce", "finish", "gather_or_scatter",
           "predict_fsdp", "predict_local_sgd", "predict_pipeline", "predict_ps", "predict_sync", "schedule",
           "simulate", "stage_plan", "steady_state"]
