"""The cost model: pure functions from measured compute, the model's sizes and the network to a step time.

Below the strategies (which register their cost models here) and the estimate (which measures the
inputs and asks): nothing here imports torch or starts a process.

- ``model.py``: :class:`CostModel`, what every strategy's cost model answers, and the registry
  keyed by the options class (:data:`COSTS`, :func:`cost_model`; filled by ``strategies.registry``);
- ``link.py``: :class:`Link`, α and β; ``inputs.py``: :class:`Compute` (a worker's measured step),
  :class:`ModelFacts` (sizes), :class:`Network` (links, workers per node) and the collectives' costs;
- ``timeline.py``: compute and communication streams, and what overlaps;
- one module per strategy, its formulas and its :class:`CostModel`: ``sync.py`` (DDP buckets
  overlapping backward), ``ps.py`` (an event simulation of workers and the server), ``local_sgd.py``,
  ``pipeline.py``, ``fsdp.py``;
- ``prediction.py``: :class:`Prediction`, one row of the report.
"""

from .inputs import Compute, ModelFacts, Network, allreduce, gather_or_scatter
from .link import Link
from .model import COSTS, Alternative, CostModel, cost_model
from .prediction import Prediction
from .timeline import Op, finish, schedule

__all__ = ["COSTS", "Alternative", "Compute", "CostModel", "Link", "ModelFacts", "Network", "Op", "Prediction",
           "allreduce", "cost_model", "finish", "gather_or_scatter", "schedule"]
